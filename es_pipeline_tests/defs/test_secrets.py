"""No password leaks: a canary password goes through a real `dagster asset materialize` (one that
succeeds, one that cannot reach its server), the GraphQL query behind the UI's resources page, and
`es-pipeline status`; then every output and every byte of Dagster's storage is searched for it."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from es_pipeline.dev.stack import free_port
from es_pipeline.dev.workload import run_workload
from es_pipeline.settings import PROJECT_ROOT
from es_pipeline.store import roles
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.roles import StoreDsn

BIN = Path(sys.executable).parent
# What the UI's resources page shows of the event store's configuration.
RESOURCE_QUERY = (
    'query { topLevelResourceDetailsOrError(resourceSelector: {repositoryLocationName: "es_pipeline.definitions", '
    'repositoryName: "__repository__", resourceName: "event_store"}) '
    "{ ... on ResourceDetails { configuredValues { key value type } } } }"
)


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300, check=False)


def _files_holding(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


@pytest.fixture
def canary_logins(dsn: StoreDsn) -> Iterator[tuple[str, dict[str, str]]]:
    """A canary password, and {group role: a DSN holding it} for an extractor and a snapshot writer login
    whose password it really is (the server checks it)."""
    canary = f"canary-{secrets.token_hex(8)}"
    made = {roles.EXTRACTOR: f"canary_x_{os.getpid()}", roles.SNAPSHOTS: f"canary_s_{os.getpid()}"}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET password_encryption = 'scram-sha-256'")
        for group, login in made.items():
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                sql.Identifier(login), sql.Literal(canary), sql.Identifier(group)))
    try:
        yield canary, {group: make_conninfo(dsn, user=login, password=canary) for group, login in made.items()}
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for login in made.values():
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(login)))


@pytest.mark.slow  # five `dagster` processes (40 s): make test's tier, not make check's
def test_a_canary_password_appears_in_no_output_and_nowhere_in_dagsters_storage(
    dsn: StoreDsn, canary_logins: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    canary, logins = canary_logins
    run_workload(EventStore(dsn.writer), streams=5, events=20, writers=1, rollback_rate=0, max_commit_delay=0)
    home = tmp_path / "dagster_home"
    home.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(home), "ES_PIPELINE_WAREHOUSE": str(tmp_path / "warehouse"),
           "ES_PIPELINE_SLICE_RANGES": "1", "ES_PIPELINE_AUTOMATION": "off",
           "ES_PIPELINE_PG_DSN": logins[roles.EXTRACTOR], "ES_PIPELINE_SNAPSHOT_DSN": logins[roles.SNAPSHOTS]}
    materialize = [str(BIN / "dagster"), "asset", "materialize", "-m", "es_pipeline.definitions",
                   "--select", "events", "--partition", "0000-1023"]
    ok = _run(materialize, env)
    assert ok.returncode == 0, ok.stderr[-3000:]
    status = _run([str(BIN / "es-pipeline"), "status"], env)
    assert status.returncode == 0, status.stderr[-3000:]
    resources_page = _run([str(BIN / "dagster-graphql"), "-m", "es_pipeline.definitions", "-t", RESOURCE_QUERY], env)
    assert resources_page.returncode == 0, resources_page.stderr[-3000:]
    answer = next(ln for ln in resources_page.stdout.splitlines() if ln.startswith('{"data"'))
    configured = json.loads(answer)["data"]["topLevelResourceDetailsOrError"]
    assert {"key": "dsn", "type": "ENV_VAR", "value": "ES_PIPELINE_PG_DSN"} in configured["configuredValues"]
    assert {"key": "snapshot_dsn", "type": "ENV_VAR", "value": "ES_PIPELINE_SNAPSHOT_DSN"} in configured["configuredValues"]

    unreachable = {**env, "ES_PIPELINE_PG_DSN": f"postgresql://postgres:{canary}@127.0.0.1:{free_port()}/es"}
    failed = _run(materialize, unreachable)
    assert failed.returncode != 0
    assert "127.0.0.1" in failed.stdout + failed.stderr  # it says where it could not connect
    cli_failed = _run([str(BIN / "es-pipeline"), "extract"], unreachable)
    assert cli_failed.returncode == 2 and "127.0.0.1" in cli_failed.stderr

    for name, out in (("materialize", ok), ("status", status), ("the resources page", resources_page),
                      ("failed materialize", failed), ("failed extract", cli_failed)):
        assert canary not in out.stdout + out.stderr, f"the password is in the output of {name}"
    assert _files_holding(home, canary.encode()) == [], "the password is in Dagster's storage"
