"""Reading the event store below the horizon: batches into Arrow (or Spark over JDBC), counts, lag.

Rows travel as Arrow straight from libpq's binary protocol (ADBC), never as Python objects.
xid8 and jsonb arrive as opaque types in ADBC, so they are cast in SQL (`tx_id::text::bigint`,
`payload::text`). Every query probes `(slice, tx_id)` once per slice: `unnest` of (slice, lower
bound) pairs joined to the events, which the planner runs as a nested loop of index range scans.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import reduce
from typing import Any

import psycopg
import pyarrow as pa
from psycopg import sql

from es_pipeline.extraction.offsets import Batch
from es_pipeline.store.conninfo import adbc_dsn, jdbc_url, no_timeouts_sql

EVENT_COLUMNS = (
    "e.global_position, e.tx_id::text::bigint AS tx_id, e.stream_id, e.stream_type, e.version, "
    "e.slice::int AS slice, e.event_type, e.payload::text AS payload, e.metadata::text AS metadata, e.recorded_at"
)


def _where(pairs: Sequence[tuple[int, int]], upper: int | None) -> tuple[str, str]:
    """FROM-clause prefix and WHERE clause selecting `lower(slice) <= tx_id < upper` per slice.

    All literals are ints of our own making (no injection possible), which also lets the planner
    see real values. When every slice shares one lower bound — the steady state, since a run moves
    all its slices to H — the condition is `slice = ANY(array) AND tx_id >= lo`: a ScalarArrayOp
    index scan, one probe per slice, and a row estimate from tx_id's statistics. Otherwise each
    slice is probed through a LATERAL subquery (OFFSET 0 keeps it from being flattened into a
    hash join over the whole table).
    """
    hi = f" AND e.tx_id < '{int(upper)}'::xid8" if upper is not None else ""
    lowers = {int(w) for _, w in pairs}
    slices = ",".join(str(int(s)) for s, _ in pairs)
    if len(lowers) == 1:
        (lo,) = lowers
        return "", f"e.slice = ANY('{{{slices}}}'::smallint[]) AND e.tx_id >= '{lo}'::xid8{hi}"
    lows = ",".join(str(int(w)) for _, w in pairs)
    return f"unnest('{{{slices}}}'::smallint[], '{{{lows}}}'::xid8[]) AS w(slice, lo)", hi


def _select(schema: str, columns: str, pairs: Sequence[tuple[int, int]], upper: int | None) -> str:
    table = sql.Identifier(schema, "events").as_string(None)
    prefix, cond = _where(pairs, upper)
    if not prefix:
        return f"SELECT {columns} FROM {table} e WHERE {cond}"
    return (
        f"SELECT {columns} FROM {prefix} CROSS JOIN LATERAL "
        f"(SELECT * FROM {table} e WHERE e.slice = w.slice AND e.tx_id >= w.lo{cond} OFFSET 0) e"
    )


def batch_query(schema: str, pairs: Sequence[tuple[int, int]], upper: int) -> str:
    return _select(schema, EVENT_COLUMNS, pairs, upper)


def jdbc_frame(spark: Any, dsn: str, schema: str, batch: Batch, *, splits: int) -> Any:
    """The rows of a batch read by Spark's executors over JDBC: `splits` queries over interleaved
    slice subsets, each bounded by the same fixed upper bound H, so a cluster shares the read and
    the result is exactly the batch that the Arrow path would read."""
    url, props = jdbc_url(dsn)
    pairs = batch.bounds
    groups = [g for g in (pairs[i::splits] for i in range(max(1, splits))) if g]
    frames = [
        spark.read.format("jdbc").option("url", url).option("query", batch_query(schema, g, batch.upper))
        .option("fetchsize", "10000").options(**props).load()
        for g in groups
    ]
    return reduce(lambda a, b: a.unionByName(b), frames)


def read_batch_arrow(dsn: str, schema: str, batch: Batch, *, parallel: int = 1) -> pa.Table:
    """The rows of a batch as one Arrow table (empty table with the right schema if none).

    With `parallel` > 1 the slices are dealt into that many groups, each read by its own
    connection at once: every group is bounded by the same fixed H, so together they are exactly
    the batch. Postgres's per-row work (jsonb to text, the filter) then runs on more than one core.
    """
    pairs = batch.bounds
    if not pairs:
        return empty_events_arrow()
    groups = [g for g in (pairs[i::max(1, parallel)] for i in range(max(1, parallel))) if g]
    if len(groups) == 1:
        return _read_arrow(dsn, batch_query(schema, pairs, batch.upper))
    with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="es-read-split") as pool:
        parts = list(pool.map(lambda g: _read_arrow(dsn, batch_query(schema, g, batch.upper)), groups))
    return pa.concat_tables(parts)


def _read_arrow(dsn: str, query: str) -> pa.Table:
    table = _fetch_arrow(dsn, query)
    return table.cast(EVENTS_ARROW_SCHEMA) if table.num_rows else empty_events_arrow()


def _fetch_arrow(dsn: str, query: str) -> pa.Table:
    import adbc_driver_postgresql.dbapi as adbc  # here, not at the top: it imports pandas (~1.4 s)

    with adbc.connect(adbc_dsn(dsn)) as conn, conn.cursor() as cur:
        cur.execute(no_timeouts_sql(local=True))  # in the read's own transaction: holds behind a pooler too
        cur.fetchall()
        cur.execute(query)
        return cur.fetch_arrow_table()


def event_keys(dsn: str, schema: str) -> pa.Table:
    """(stream_id, version, recorded_at as UTC microseconds) of every event in the store (for a rebase)."""
    table = sql.Identifier(schema, "events").as_string(None)
    keys = _fetch_arrow(dsn, f"SELECT stream_id, version, recorded_at FROM {table}")
    return pa.table({
        "stream_id": keys["stream_id"].cast(pa.string()), "version": keys["version"].cast(pa.int32()),
        "recorded_at": keys["recorded_at"].cast(pa.timestamp("us", tz="UTC")).cast(pa.int64()),
    })


EVENTS_ARROW_SCHEMA = pa.schema(
    [
        ("global_position", pa.int64()),
        ("tx_id", pa.int64()),
        ("stream_id", pa.string()),
        ("stream_type", pa.string()),
        ("version", pa.int32()),
        ("slice", pa.int32()),
        ("event_type", pa.string()),
        ("payload", pa.string()),
        ("metadata", pa.string()),
        ("recorded_at", pa.timestamp("us", tz="UTC")),
    ]
)


def empty_events_arrow() -> pa.Table:
    return EVENTS_ARROW_SCHEMA.empty_table()


@dataclass(frozen=True)
class Lag:
    events_behind: int  # committed events at or above the horizon (not yet extractable)
    oldest_open_tx_seconds: float  # age of the oldest open (or prepared) transaction holding H back


def count_between(
    conn: psycopg.Connection, schema: str, pairs: Sequence[tuple[int, int]], upper: int | None
) -> int:
    if not pairs:
        return 0
    row = conn.execute(_select(schema, "count(*)", pairs, upper)).fetchone()  # type: ignore[arg-type]
    return int(row[0]) if row else 0


def first_tx_ids(conn: psycopg.Connection, schema: str, pairs: Sequence[tuple[int, int]], upper: int) -> int | None:
    """The smallest tx_id in the backlog: one index probe per slice."""
    if not pairs:
        return None
    table = sql.Identifier(schema, "events").as_string(conn)
    slices = ",".join(str(int(s)) for s, _ in pairs)
    lows = ",".join(str(int(w)) for _, w in pairs)
    row = conn.execute(
        f"SELECT min(f.tx_id::text::bigint) FROM unnest('{{{slices}}}'::smallint[], '{{{lows}}}'::xid8[]) "  # type: ignore[arg-type]
        f"AS w(slice, lo) CROSS JOIN LATERAL (SELECT e.tx_id FROM {table} e WHERE e.slice = w.slice "
        f"AND e.tx_id >= w.lo AND e.tx_id < '{int(upper)}'::xid8 ORDER BY e.tx_id LIMIT 1) f"
    ).fetchone()
    return int(row[0]) if row and row[0] is not None else None


def oldest_open_transaction_seconds(conn: psycopg.Connection) -> float:
    """Age of the oldest transaction that holds an xid (open or prepared): what holds H back."""
    row = conn.execute(
        "SELECT greatest("
        " (SELECT coalesce(extract(epoch FROM now() - min(xact_start)), 0) FROM pg_stat_activity"
        "  WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()),"
        " (SELECT coalesce(extract(epoch FROM now() - min(prepared)), 0) FROM pg_prepared_xacts))"
    ).fetchone()
    return float(row[0]) if row and row[0] is not None else 0.0


def lag(conn: psycopg.Connection, schema: str, slices: Sequence[int], horizon: int) -> Lag:
    behind = count_between(conn, schema, [(s, horizon) for s in slices], None)
    return Lag(behind, oldest_open_transaction_seconds(conn))
