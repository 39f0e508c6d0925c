"""The test store's set-up and reads shared by several test files: a store partitioned by tenant, a mixed
workload, a transaction counter moved on, the `events` consumer's watermarks and the store's snapshots."""

from __future__ import annotations

from typing import Any

import psycopg

from es_pipeline.dev.workload import run_workload
from es_pipeline.source.mapping import load
from es_pipeline.store import roles, tenants
from es_pipeline.store.event_store import EventStore
from es_pipeline.store.migrations import migrate


def make_tenant_store(dsn: str, *names: str) -> None:
    """Make the empty database `dsn` a store partitioned by tenant, with the role model and tenants `names`."""
    migrate(dsn, tenants=True)
    roles.apply(dsn, "es", echo=lambda _: None)
    if names:
        source = load("es-tenants")
        with psycopg.connect(dsn, autocommit=True) as conn:
            for name in names:
                tenants.add(conn, source, name)


def append_workload(dsn: str, events: int, seed: int, writers: int = 2) -> None:
    """`events` events on 40 streams by `writers` writers: 10% rolled back, commits held up to 10 ms."""
    run_workload(EventStore(dsn), streams=40, events=events, writers=writers, rollback_rate=0.1,
                 max_commit_delay=0.01, seed=seed)


def burn_transaction_ids(dsn: str, transactions: int) -> None:
    """Move the cluster's transaction counter on, as years of traffic would."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(transactions):
            conn.execute("SELECT pg_current_xact_id()")


def watermark_count(dsn: str) -> int:
    """How many slices hold a watermark of the `events` consumer in es_pipeline.offsets."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM es_pipeline.offsets WHERE consumer = 'events'").fetchone()
    return int(row[0]) if row else 0


def stored_snapshots(dsn: str) -> dict[str, tuple[int, int, Any]]:
    """The store's es.snapshots: stream id -> (version, revision, state)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT stream_id, version, revision, state FROM es.snapshots").fetchall()
    return {s: (v, r, state) for s, v, r, state in rows}
