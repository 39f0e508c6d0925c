"""The demo workload commits exactly what it reports, with out-of-order commits."""

from __future__ import annotations

import threading
import time

import psycopg

from es_pipeline.dev.workload import run_workload
from es_pipeline.store.event_store import EventStore


def test_eight_writers_with_rollbacks_commit_exactly_what_they_report(dsn: str) -> None:
    report = run_workload(
        EventStore(dsn), streams=200, events=3000, writers=8, rollback_rate=0.15, max_commit_delay=0.03, seed=7
    )
    with psycopg.connect(dsn) as conn:
        events, streams, versions_ok = conn.execute(
            "SELECT count(*), count(DISTINCT stream_id), "
            " bool_and(version = rn) FROM (SELECT stream_id, version, "
            " row_number() OVER (PARTITION BY stream_id ORDER BY version) AS rn FROM es.events) e"
        ).fetchone()  # type: ignore[misc]
        # Commit order vs transaction-id order (track_commit_timestamp is on in the local server).
        out_of_order = conn.execute(
            "WITH t AS (SELECT DISTINCT tx_id, pg_xact_commit_timestamp((tx_id::text::bigint % 4294967296)::text::xid) AS ts "
            "           FROM es.events) "
            "SELECT count(*) FROM (SELECT ts, max(ts) OVER (ORDER BY tx_id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_max FROM t) x "
            "WHERE ts < prev_max"
        ).fetchone()[0]  # type: ignore[index]
    assert report.events == 3000 == events
    assert report.streams == streams
    assert report.rollbacks > 0
    assert versions_ok, "versions are 1..n per stream, no gaps"
    assert out_of_order > 0, "some transaction committed before a lower tx_id did"


def test_a_connection_lost_before_a_rollback_is_a_database_error_not_a_stray_rollback(dsn: str) -> None:
    """A server crash while a writer holds a transaction it means to roll back: psycopg's ROLLBACK fails and
    a raised `Rollback` would escape (not a `psycopg.Error`: the crash drill's writers died of it). The workload
    rolls back at the block's end instead, so the lost connection surfaces as `OperationalError`, which
    callers that ride out a crash already catch."""
    errors: list[BaseException] = []

    def write() -> None:
        try:
            run_workload(EventStore(dsn), streams=1, events=10, writers=1, rollback_rate=0.999, max_commit_delay=2.0)
        except BaseException as exc:  # noqa: BLE001 - the test looks at what escaped
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    with psycopg.connect(dsn, autocommit=True) as admin:
        deadline = time.monotonic() + 20
        while writer.is_alive() and time.monotonic() < deadline:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
                          " AND pid <> pg_backend_pid() AND state = 'idle in transaction'"
                          " AND state_change < clock_timestamp() - interval '0.3 s'")  # in its hold, past the append
            time.sleep(0.05)
    writer.join(10)
    assert not writer.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], psycopg.OperationalError), errors
