"""What the event store says about the pipeline's health, read as the extractor's role (no Dagster here).

One reading is a handful of statements on one kept autocommit connection (no transaction held open, so it holds
neither the horizon nor a lock), each given up after 5 s: the horizon and the transaction holding it,
per slice range the events waiting (counted through the index, up to `CAP`) and the last time its watermarks
moved, the slices whose locks a run holds (a tailing run alive holds all of its range's), the pending batches,
and whether the store is still the one the offsets were recorded on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psycopg

from es_pipeline.errors import EsPipelineError
from es_pipeline.extraction import reader
from es_pipeline.extraction.offsets import check_source, lock_namespace
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.source.mapping import Source

CAP = 10_000  # events counted per range and reading at most (a backfill shows as 10,000: "at least")
STATEMENT_TIMEOUT = "5s"  # a reading blocked (a lock, an overloaded server) gives up rather than hang every scrape

_HOLDER = """
SELECT kind, pid, application_name, usename, state, seconds, xid FROM (
    SELECT 'session' AS kind, pid, application_name, usename::text AS usename, state,
           extract(epoch FROM now() - xact_start)::float8 AS seconds, backend_xid::text AS xid, age(backend_xid) AS age
    FROM pg_stat_activity WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
    UNION ALL
    SELECT 'prepared', NULL, gid, owner::text, 'prepared', extract(epoch FROM now() - prepared)::float8,
           transaction::text, age(transaction)
    FROM pg_prepared_xacts) t
ORDER BY age DESC NULLS LAST LIMIT 1
"""


@dataclass(frozen=True)
class Holder:
    """The oldest transaction with an id: what holds the horizon back. `pid` is None for a prepared transaction
    (its `application_name` is then its gid); `seconds` is None where the role may not see its start."""

    kind: str
    pid: int | None
    application_name: str
    user: str
    state: str
    seconds: float | None
    xid: int


@dataclass(frozen=True)
class RangeReading:
    key: str
    waiting: reader.Waiting
    last_advance: float | None  # when a watermark of the range last moved (seconds since the epoch)
    slices_locked: int  # slices of the range whose lock a run holds
    slices: int


@dataclass
class StoreReading:
    horizon: int
    holder: Holder | None
    ranges: list[RangeReading]
    pending_batches: int
    source_problem: str | None  # why no run would extract (a restore, a standby), one line; None when fine
    lock_holders: dict[int, str] = field(default_factory=dict)  # pid → application name of the runs holding slices
    taken_at: float = 0.0


def read_store(conn: psycopg.Connection, source: Source, ranges: list[SliceRange]) -> StoreReading:
    consumer = source.consumer
    conn.execute(f"SET statement_timeout = '{STATEMENT_TIMEOUT}'")
    problem = None
    try:
        check_source(conn, consumer, source)
    except EsPipelineError as exc:
        problem = str(exc).splitlines()[0]
    horizon_row = conn.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint").fetchone()
    assert horizon_row is not None
    horizon = int(horizon_row[0])
    h = conn.execute(_HOLDER).fetchone()
    holder = None if h is None else Holder(str(h[0]), h[1], h[2] or "", h[3] or "", h[4] or "", h[5], int(h[6]))
    locks = conn.execute(
        "SELECT l.objid::int, l.pid, coalesce(a.application_name, '') FROM pg_locks l "
        "LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.classid = %s::oid AND l.objsubid = 2 AND l.granted",
        (lock_namespace(consumer),)).fetchall()
    locked = {int(s) for s, _, _ in locks}
    # Every slice's watermark and when it last moved, in one read (a slice never extracted: watermark 0).
    offsets = conn.execute(
        "SELECT slice, watermark::text::bigint, extract(epoch FROM updated_at)::float8 FROM es_pipeline.offsets "
        "WHERE consumer = %s", (consumer,)).fetchall()
    marks = {int(s): int(w) for s, w, _ in offsets}
    updated = {int(s): float(t) for s, _, t in offsets}
    out = []
    for r in ranges:
        w = reader.waiting(conn, source, [(s, marks.get(s, 0)) for s in r.slices], horizon, cap=CAP)
        times = [updated[s] for s in r.slices if s in updated]
        out.append(RangeReading(r.key, w, max(times) if times else None,
                                sum(1 for s in r.slices if s in locked), len(r.slices)))
    pending = conn.execute("SELECT count(*) FROM es_pipeline.pending_batches WHERE consumer = %s",
                           (consumer,)).fetchone()
    return StoreReading(horizon, holder, out, int(pending[0]) if pending else 0, problem,
                        {int(pid): name for _, pid, name in locks}, time.time())
