"""End to end through a real Dagster daemon on Postgres storage: sensor on, writers writing, a run
killed mid-batch; within a bounded wait every committed event is in Delta exactly once, and no two
runs of one range ever overlapped."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from es_pipeline.dev.stack import alive, dagster_stack, run_pid
from es_pipeline.dev.workload import run_workload
from es_pipeline.instance.launcher import PID_TAG
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.lakecheck import assert_exactly_once, source_events


def _lake_keys(warehouse: Path) -> set[tuple[str, int]]:
    from deltalake import DeltaTable
    from deltalake.exceptions import DeltaError

    path = warehouse / "events"
    if not (path / "_delta_log").is_dir():
        return set()
    try:
        t = DeltaTable(str(path)).to_pyarrow_table(columns=["stream_id", "version"])
    except DeltaError:  # the first commit is still being written
        return set()
    return set(zip(t.column("stream_id").to_pylist(), t.column("version").to_pylist(), strict=True))


@pytest.mark.timeout(900)
def test_daemon_sensor_brings_every_committed_event_exactly_once_despite_a_killed_run(
    pg_server: str, dsn: str, spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with dagster_stack(admin_dsn=pg_server, dsn=dsn, tmp=tmp_path) as stack:
        for key in ("DAGSTER_HOME", "DAGSTER_PG_URL"):
            monkeypatch.setenv(key, stack.env[key])
        instance = dg.DagsterInstance.get()
        stop = threading.Event()
        writer = threading.Thread(target=run_workload, args=(EventStore(dsn),), kwargs=dict(
            streams=100, events=None, writers=4, rollback_rate=0.1, max_commit_delay=0.2, rate=25.0, stop=stop))
        writer.start()
        killed = None
        deadline = time.monotonic() + 240
        while killed is None and time.monotonic() < deadline:  # kill the first run caught mid-flight
            for record in instance.get_run_records(dg.RunsFilter(job_name="events_job", statuses=[dg.DagsterRunStatus.STARTED])):
                pid = run_pid(instance, record.dagster_run.run_id)
                if pid and alive(pid):
                    os.kill(pid, signal.SIGKILL)
                    # An `events` run takes about a second now: one that finished before the signal
                    # landed was not killed, so look for another.
                    time.sleep(3.0)
                    if instance.get_run_by_id(record.dagster_run.run_id).status != dg.DagsterRunStatus.SUCCESS:
                        killed = record.dagster_run
                        break
            time.sleep(0.2)
        assert killed is not None, "no run was ever seen running"
        # Run monitoring asks the launcher whether the run's process lives: the killed run is marked
        # failed by the daemon itself, which frees its range's place in the queue.
        deadline = time.monotonic() + 90
        while instance.get_run_by_id(killed.run_id).status == dg.DagsterRunStatus.STARTED and time.monotonic() < deadline:
            time.sleep(1.0)
        assert instance.get_run_by_id(killed.run_id).status == dg.DagsterRunStatus.FAILURE
        time.sleep(15)
        stop.set()
        writer.join()
        expected = set(source_events(dsn))
        deadline = time.monotonic() + 300
        while _lake_keys(stack.warehouse) != expected and time.monotonic() < deadline:
            time.sleep(2)
        records = instance.get_run_records(dg.RunsFilter(job_name="events_job"))
    assert assert_exactly_once(spark, stack.warehouse, dsn) == len(expected) > 0
    by_range: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        if r.start_time is not None:
            by_range.setdefault(r.dagster_run.tags.get("dagster/partition", ""), []).append(
                (r.start_time, r.end_time or time.time()))
    assert len(records) >= 3
    assert all(PID_TAG in r.dagster_run.tags for r in records), "every run was forked from the warm worker"
    for key, spans in by_range.items():
        spans.sort()
        for (a0, a1), (b0, _) in zip(spans, spans[1:], strict=False):
            assert b0 >= a1 - 0.5, f"two runs of {key} overlapped: {a0}-{a1} and {b0}"
