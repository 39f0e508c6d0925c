"""End to end through a real Dagster daemon on Postgres storage: sensor on, writers writing, a run
killed mid-batch; within a bounded wait every committed event is in Delta exactly once, and no two
runs of one range ever overlapped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from es_pipeline.dev.connect_token import TOKEN_ENV
from es_pipeline.dev.stack import alive, dagster_stack, run_pid
from es_pipeline.dev.workload import run_workload
from es_pipeline.instance.launcher import PID_TAG
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.lakecheck import assert_exactly_once_by_key, source_events
from es_pipeline_tests.support.roles import StoreDsn
from es_pipeline_tests.support.waiting import stack_doing, wait_for


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


def _spark_connect_without_token(remote: str) -> subprocess.CompletedProcess[str]:
    """A Spark Connect client that does not hold the server's token: the server must refuse it."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    code = f"from pyspark.sql import SparkSession; SparkSession.builder.remote({remote!r}).getOrCreate().range(1).count()"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.timeout(900)
def test_daemon_sensor_brings_every_committed_event_exactly_once_despite_a_killed_run(
    pg_server: str, dsn: StoreDsn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with dagster_stack(admin_dsn=pg_server, dsn=dsn.extractor, tmp=tmp_path) as stack:
        for key in ("DAGSTER_HOME", "DAGSTER_PG_URL"):
            monkeypatch.setenv(key, stack.env[key])
        refused = _spark_connect_without_token(stack.env["ES_PIPELINE_SPARK_REMOTE"])
        assert refused.returncode != 0 and "authentication token" in refused.stderr, refused.stderr[-2000:]
        instance = dg.DagsterInstance.get()
        stop = threading.Event()
        writer = threading.Thread(target=run_workload, args=(EventStore(dsn.writer),), kwargs=dict(
            streams=100, events=None, writers=4, rollback_rate=0.1, max_commit_delay=0.2, rate=25.0, stop=stop))
        writer.start()
        doing = stack_doing(instance, tmp_path / "logs")

        def kill_one_mid_flight() -> Any:
            for record in instance.get_run_records(dg.RunsFilter(job_name="events_job", statuses=[dg.DagsterRunStatus.STARTED])):
                pid = run_pid(instance, record.dagster_run.run_id)
                if pid and alive(pid):
                    os.kill(pid, signal.SIGKILL)
                    # An `events` run takes about a second now: one that finished before the signal
                    # landed was not killed, so look for another.
                    time.sleep(3.0)
                    if instance.get_run_by_id(record.dagster_run.run_id).status != dg.DagsterRunStatus.SUCCESS:
                        return record.dagster_run
            return None

        killed = wait_for(kill_one_mid_flight, 240, "a run caught mid-flight and killed", every=0.2, doing=doing)
        # Run monitoring asks the launcher whether the run's process lives: the killed run is marked
        # failed by the daemon itself, which frees its range's place in the queue.
        wait_for(lambda: instance.get_run_by_id(killed.run_id).status != dg.DagsterRunStatus.STARTED, 90,
                 "run monitoring to mark the killed run ended", every=1.0, doing=doing)
        assert instance.get_run_by_id(killed.run_id).status == dg.DagsterRunStatus.FAILURE
        time.sleep(15)
        stop.set()
        writer.join()
        expected = set(source_events(dsn))
        wait_for(lambda: _lake_keys(stack.warehouse) == expected, 300, "every committed event in the lake",
                 every=2.0, doing=doing)
        records = instance.get_run_records(dg.RunsFilter(job_name="events_job"))
    # Read back with delta-rs: this worker starts no Spark session (nor the S3 server one would need) for a check.
    assert assert_exactly_once_by_key(stack.warehouse, dsn) == len(expected) > 0
    by_range: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        if r.start_time is not None:
            by_range.setdefault(r.dagster_run.tags.get("dagster/partition", ""), []).append(
                (r.start_time, r.end_time or time.time()))
    assert len(records) >= 3
    # Runs still queued when the records were read were never launched (the sensor goes on requesting runs
    # until the stack stops), and one launched an instant before has no pid tag yet: the finished ones say
    # how each run was launched.
    ended = [r for r in records if r.dagster_run.status in (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE)]
    assert len(ended) >= 3
    default_launched = [r.dagster_run.run_id for r in ended if PID_TAG not in r.dagster_run.tags]
    assert not default_launched, f"every run was forked from the warm worker; these were not: {default_launched}"
    for key, spans in by_range.items():
        spans.sort()
        for (a0, a1), (b0, _) in zip(spans, spans[1:], strict=False):
            assert b0 >= a1 - 0.5, f"two runs of {key} overlapped: {a0}-{a1} and {b0}"


@pytest.mark.timeout(600)
def test_a_hung_run_is_stopped_at_the_maximum_runtime_and_its_range_goes_on(
    pg_server: str, dsn: StoreDsn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run blocked for ever (here, on a table lock that never comes) is interrupted by run monitoring
    at `max_runtime_seconds`, marked failed, and the range's next run brings every event exactly once."""
    store = EventStore(dsn)
    with dagster_stack(admin_dsn=pg_server, dsn=dsn.extractor, tmp=tmp_path, slice_ranges=1, sensor_interval=1,
                       connect=False, max_runtime_seconds=15) as stack:
        for key in ("DAGSTER_HOME", "DAGSTER_PG_URL"):
            monkeypatch.setenv(key, stack.env[key])
        instance = dg.DagsterInstance.get()
        doing = stack_doing(instance, tmp_path / "logs")
        run_workload(store, streams=10, events=20, writers=1, rollback_rate=0, max_commit_delay=0)
        wait_for(lambda: _lake_keys(stack.warehouse) == set(source_events(dsn)), 180, "the first events in the lake", doing=doing)
        wait_for(lambda: not _runs(instance, dg.DagsterRunStatus.STARTED), 60, "the first runs to finish", doing=doing)
        before = {r.run_id for r in _runs(instance, None)}
        with psycopg.connect(dsn) as holder:
            # Every run now waits to record its batch; a SHARE lock takes no transaction id, so the
            # horizon, and the sensor, go on.
            holder.execute("LOCK TABLE es_pipeline.pending_batches IN SHARE MODE")
            run_workload(store, streams=10, events=20, writers=1, rollback_rate=0, max_commit_delay=0)
            started = time.monotonic()
            hung = wait_for(lambda: [r for r in _runs(instance, dg.DagsterRunStatus.STARTED) if r.run_id not in before],
                             120, "a run that hangs", doing=doing)[0]
            wait_for(lambda: instance.get_run_by_id(hung.run_id).is_finished, 120, "the hung run to be stopped", doing=doing)
            stopped_after = time.monotonic() - started
            assert instance.get_run_by_id(hung.run_id).status == dg.DagsterRunStatus.FAILURE
            pid = int(hung.tags[PID_TAG])
            wait_for(lambda: not alive(pid), 30, "the hung run's process to end", doing=doing)
            holder.rollback()
        expected = set(source_events(dsn))
        wait_for(lambda: _lake_keys(stack.warehouse) == expected, 180, "every event in the lake after the lock", doing=doing)
        from deltalake import DeltaTable

        assert DeltaTable(str(stack.warehouse / "events")).to_pyarrow_dataset().count_rows() == len(expected) == 40
    assert 15 <= stopped_after <= 90, stopped_after


def _runs(instance: Any, status: Any) -> list[Any]:
    """The `events_job` runs in `status` (None: all)."""
    runs = dg.RunsFilter(job_name="events_job", statuses=[status] if status else [])
    return [r.dagster_run for r in instance.get_run_records(runs)]


@pytest.mark.timeout(600)
def test_tailing_runs_report_their_passes_and_a_run_killed_mid_batch_loses_and_repeats_nothing(
    pg_server: str, dsn: StoreDsn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ES_PIPELINE_TAIL_SECONDS: the sensor starts one run over every range, which stays, extracting as commits
    arrive, its passes materializations of the partitions they brought events to. One is killed between its
    Delta commit and its offsets (held there by a lock on the offsets); the next run replays that batch, and
    the lake equals the store."""
    tail = 120  # the run chosen (3 passes reported within 70 s of its start) has passes left while the lock is held
    with dagster_stack(admin_dsn=pg_server, dsn=dsn.extractor, tmp=tmp_path, slice_ranges=2, sensor_interval=1,
                       connect=False, extra_env={"ES_PIPELINE_TAIL_SECONDS": str(tail)}) as stack:
        for key in ("DAGSTER_HOME", "DAGSTER_PG_URL"):
            monkeypatch.setenv(key, stack.env[key])
        instance = dg.DagsterInstance.get()
        doing = stack_doing(instance, tmp_path / "logs")
        stop = threading.Event()
        writer = threading.Thread(target=run_workload, args=(EventStore(dsn.writer),), kwargs=dict(
            streams=60, events=None, writers=2, rollback_rate=0.1, max_commit_delay=0.1, rate=20.0, stop=stop))
        writer.start()
        try:
            def passes_of(run_id: str) -> int:
                logs = instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
                return max((e.asset_materialization.metadata["last_pass"].value for e in logs
                            if e.asset_materialization and "last_pass" in e.asset_materialization.metadata), default=0)

            def young_with_three_passes() -> list[Any]:
                started = instance.get_run_records(dg.RunsFilter(job_name="events_job",
                                                                 statuses=[dg.DagsterRunStatus.STARTED]))
                return [r.dagster_run for r in started if r.start_time and time.time() - r.start_time < 70
                        and passes_of(r.dagster_run.run_id) >= 3]

            tailing = wait_for(young_with_three_passes, 180, "a run with three passes and most of its tail left", doing=doing)[0]
            with psycopg.connect(dsn) as holder:
                holder.execute("LOCK TABLE es_pipeline.offsets IN SHARE MODE")  # the next offsets commit waits
                wait_for(lambda: _in_delta_not_in_offsets(dsn, stack.warehouse, tailing.run_id), 60,
                          "a batch of the tailing run in Delta, its offsets waiting", doing=doing)
                os.kill(int(tailing.tags[PID_TAG]), signal.SIGKILL)
                holder.rollback()
            wait_for(lambda: instance.get_run_by_id(tailing.run_id).status == dg.DagsterRunStatus.FAILURE, 90,
                      "the killed run to be marked failed", doing=doing)
            time.sleep(10)
        finally:
            stop.set()
            writer.join()
        expected = set(source_events(dsn))
        wait_for(lambda: _lake_keys(stack.warehouse) == expected, 240, "every event in the lake", doing=doing)
        from deltalake import DeltaTable

        assert DeltaTable(str(stack.warehouse / "events")).to_pyarrow_dataset().count_rows() == len(expected)
        records = instance.get_run_records(dg.RunsFilter(job_name="events_job"))
        assert all(r.dagster_run.tags.get("es_pipeline/tail_seconds") == str(tail) for r in records)
        assert len(records) <= 8, f"{len(records)} runs: tailing runs stay instead of one run per commit"
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT count(*) FROM es_pipeline.pending_batches").fetchone() == (0,)


def _in_delta_not_in_offsets(dsn: str, warehouse: Path, run_id: str) -> bool:
    """A batch of `run_id` that Delta holds while it is still pending: its offsets wait on the lock."""
    from deltalake import DeltaTable

    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT app_id, batch_id FROM es_pipeline.pending_batches WHERE run_id = %s",
                            (run_id,)).fetchall()
    if not rows:
        return False
    table = DeltaTable(str(warehouse / "events"))
    return any((table.transaction_version(app) or -1) >= batch for app, batch in rows)
