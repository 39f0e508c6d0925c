"""A fault drill: PostgreSQL crash-restarted twice while writers append and extraction processes run,
some of them SIGKILLed at random moments; then the lake equals the store, event by event."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from es_pipeline.dev.workload import run_workload
from es_pipeline.errors import EsPipelineError
from es_pipeline.extraction.slices import split
from es_pipeline.store import roles
from es_pipeline.store.event_store import EventStore
from es_pipeline.store.migrations import migrate
from es_pipeline_tests.support.cluster import cluster
from es_pipeline_tests.support.lakecheck import assert_exactly_once
from es_pipeline_tests.support.roles import StoreDsn, login_roles

CLI = str(Path(sys.executable).parent / "es-pipeline")


def _writers(dsn: str, stop: threading.Event) -> None:
    """Append in small workloads until stopped; a crash only fails the workload it hits."""
    seed = 0
    while not stop.is_set():
        seed += 1
        try:
            run_workload(EventStore(dsn), streams=20, events=60, writers=3, rollback_rate=0.1,
                         max_commit_delay=0.02, seed=seed)
        except (psycopg.Error, EsPipelineError):
            time.sleep(0.3)


def _extract(env: dict[str, str], key: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([CLI, "extract", "--range", key], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


# Slow: a cluster of its own, crash-restarted twice in 40 s while extraction processes run (about 65 s alone). In the main suite, not
# the e2e tier that `make test` runs beside the other majors' tests: it computes more than it waits.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_crash_restarts_and_killed_extractions_lose_and_repeat_nothing(spark: Any, tmp_path: Path) -> None:
    rng = random.Random(7)
    warehouse = tmp_path / "warehouse"
    with cluster("crash") as c, ExitStack() as stack:
        with psycopg.connect(c.admin_dsn, autocommit=True) as conn:
            conn.execute('CREATE DATABASE "drill"')
        admin = make_conninfo(c.admin_dsn, dbname="drill")
        migrate(admin)
        roles.apply(admin, "es", echo=lambda _: None)
        logins = stack.enter_context(login_roles(c.admin_dsn))
        dsn = StoreDsn.of(admin, logins)
        env = {**os.environ, "ES_PIPELINE_PG_DSN": dsn.extractor, "ES_PIPELINE_WAREHOUSE": str(warehouse),
               "ES_PIPELINE_SLICE_RANGES": "4"}
        keys = [r.key for r in split(4)]
        stop = threading.Event()
        writing = threading.Thread(target=_writers, args=(dsn.writer, stop))
        writing.start()
        killed = crashes = 0
        try:
            deadline = time.monotonic() + 40
            crash_at = [time.monotonic() + 10, time.monotonic() + 25]
            while time.monotonic() < deadline:
                runs = [_extract(env, k) for k in rng.sample(keys, 2)]
                time.sleep(rng.uniform(0.5, 2.5))
                for p in runs:
                    if p.poll() is None and rng.random() < 0.5:
                        os.killpg(p.pid, signal.SIGKILL)  # mid-batch, wherever it is
                        killed += 1
                if crash_at and time.monotonic() > crash_at[0]:
                    crash_at.pop(0)
                    c.crash_restart()
                    crashes += 1
                for p in runs:
                    p.wait(120)
        finally:
            stop.set()
            writing.join(120)
        assert crashes == 2 and killed > 0
        for _ in range(3):  # everything committed is below the horizon now: catch up, range by range
            for k in keys:
                subprocess.run([CLI, "extract", "--range", k], env=env, check=True, capture_output=True)
        n = assert_exactly_once(spark, warehouse, dsn)
        assert n > 500, "the writers got events in"
