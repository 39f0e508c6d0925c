"""The demo (and `make dev`'s writers) write made-up events only into the project's own local server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from es_pipeline.dev.demo import ensure_local_target
from es_pipeline.errors import ForeignDemoTarget
from es_pipeline.settings import Settings

CLI = str(Path(sys.executable).parent / "es-pipeline")
FOREIGN = "postgresql://app:s3cret-canary@db.prod.example:5432/orders"


@pytest.mark.parametrize("dsn", [FOREIGN, "host=127.0.0.1 port=5432 dbname=es", "dbname=es"])
def test_a_foreign_store_is_refused(dsn: str) -> None:
    with pytest.raises(ForeignDemoTarget, match="Nothing was written"):
        ensure_local_target(Settings.from_env({"ES_PIPELINE_PG_DSN": dsn}))


def test_any_database_of_the_local_server_is_the_demos() -> None:
    """Accepted (no ForeignDemoTarget) exactly where host and port are the local server's: the same DSN with
    another local port configured is refused."""
    ensure_local_target(Settings.from_env({}))
    elsewhere = "postgresql://postgres@localhost:6000/x"
    ensure_local_target(Settings.from_env({"ES_PIPELINE_PG_DSN": elsewhere, "ES_PIPELINE_LOCAL_PG_PORT": "6000"}))
    with pytest.raises(ForeignDemoTarget, match="localhost:6000/x"):
        ensure_local_target(Settings.from_env({"ES_PIPELINE_PG_DSN": elsewhere, "ES_PIPELINE_LOCAL_PG_PORT": "6001"}))


@pytest.mark.parametrize("args", [["demo", "load", "--events", "10"], ["demo", "run"], ["demo", "load", "--check"]])
def test_the_demo_commands_refuse_in_one_line_without_the_password(args: list[str]) -> None:
    env = {**os.environ, "ES_PIPELINE_PG_DSN": FOREIGN}
    done = subprocess.run([CLI, *args], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "db.prod.example:5432/orders" in done.stderr
    assert "s3cret-canary" not in done.stdout + done.stderr
