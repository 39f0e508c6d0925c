"""The demo workload commits exactly what it reports, with out-of-order commits."""

from __future__ import annotations

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
