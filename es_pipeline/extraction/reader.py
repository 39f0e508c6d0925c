"""Reading the event store below the horizon: batches into Arrow (or Spark over JDBC), counts, lag.

Rows travel as Arrow straight from libpq's binary protocol (ADBC), never as Python objects, and
as a stream of record batches (`stream_batch`): a batch, even one transaction of gigabytes, is
never held whole in memory.
Every read goes through the source's mapping (`Source.relation()`, source/mapping.py), which shows
any event table under the native columns. xid8 and jsonb arrive as opaque types in ADBC, so they are
cast in SQL (`tx_id::text::bigint`, JSON as text); binary payloads are decoded after the read. Every query probes `(slice, tx_id)` once per slice: `unnest` of (slice, lower
bound) pairs joined to the events, which the planner runs as a nested loop of index range scans.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import reduce
from typing import Any

import psycopg
import pyarrow as pa

from es_pipeline.errors import SourceNotServable
from es_pipeline.extraction.offsets import Batch
from es_pipeline.lake.delta.tables import UTC_MICROS
from es_pipeline.lake.events import READ_SCHEMA
from es_pipeline.source import payloads
from es_pipeline.source.mapping import Source, as_source
from es_pipeline.store.conninfo import adbc_dsn, int_array, jdbc_url, no_timeouts_sql, resolved

EVENT_COLUMNS = (
    "e.global_position, e.tx_id::text::bigint AS tx_id, e.stream_id, e.stream_type, e.version, "
    "e.slice::int AS slice, e.event_type, e.payload, e.metadata, e.recorded_at, e.payload_encoding, e.tenant"
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
    if len(lowers) == 1:
        (lo,) = lowers
        return "", f"e.slice = ANY('{int_array(s for s, _ in pairs)}'::smallint[]) AND e.tx_id >= '{lo}'::xid8{hi}"
    return _per_slice(pairs), hi


def _per_slice(pairs: Sequence[tuple[int, int]]) -> str:
    """A FROM item of one row per (slice, lower bound): `w(slice, lo)`."""
    slices, lows = int_array(s for s, _ in pairs), int_array(w for _, w in pairs)
    return f"unnest('{slices}'::smallint[], '{lows}'::xid8[]) AS w(slice, lo)"


def _select(source: Source | str, columns: str, pairs: Sequence[tuple[int, int]], upper: int | None) -> str:
    table = as_source(source).relation()
    prefix, cond = _where(pairs, upper)
    if not prefix:
        return f"SELECT {columns} FROM {table} e WHERE {cond}"
    return (
        f"SELECT {columns} FROM {prefix} CROSS JOIN LATERAL "
        f"(SELECT * FROM {table} e WHERE e.slice = w.slice AND e.tx_id >= w.lo{cond} OFFSET 0) e"
    )


def batch_query(source: Source | str, pairs: Sequence[tuple[int, int]], upper: int) -> str:
    return _select(source, EVENT_COLUMNS, pairs, upper)


def jdbc_frame(
    spark: Any, dsn: str, source: Source | str, batch: Batch, *, splits: int, params: dict[str, str] | None = None
) -> Any:
    """The rows of a batch read by Spark's executors over JDBC: `splits` queries over interleaved
    slice subsets, each bounded by the same fixed upper bound H, so a cluster shares the read and
    the result is exactly the batch that the Arrow path would read. `params`: `resolved(dsn)`, if the
    caller has it already (a run resolves once, not per batch)."""
    url, props = jdbc_url(params if params is not None else resolved(dsn))
    frames = [
        spark.read.format("jdbc").option("url", url).option("query", query)
        .option("fetchsize", "10000").options(**props).load()
        for query in batch_queries(source, batch, splits)
    ]
    return reduce(lambda a, b: a.unionByName(b), frames)


STREAM_QUEUE_DEPTH = 4  # record batches (ADBC makes them ~16 MB) waiting per batch read, at most
_END = object()


def batch_queries(source: Source | str, batch: Batch, parallel: int) -> list[str]:
    """The queries that together read exactly `batch`: its slices dealt into `parallel` groups.

    Every group is bounded by the same fixed upper bound, so together they are exactly the batch,
    and Postgres's per-row work (jsonb to text, the filter) runs on more than one core.
    """
    pairs = batch.bounds
    groups = [g for g in (pairs[i::max(1, parallel)] for i in range(max(1, parallel))) if g]
    return [batch_query(source, g, batch.upper) for g in groups]


def stream_batch(dsn: str, source: Source | str, batch: Batch, *, parallel: int = 1) -> Iterator[pa.RecordBatch]:
    """The rows of a batch as a stream of Arrow record batches (EVENTS_ARROW_SCHEMA), memory bounded.

    Each query runs on its own connection in its own thread and hands record batches over a queue
    of `STREAM_QUEUE_DEPTH`: reading goes on while the consumer writes, and stops when it stops.
    """
    source = as_source(source)
    queries = batch_queries(source, batch, parallel)
    if not queries:
        return
    handoff: queue.Queue[object] = queue.Queue(maxsize=STREAM_QUEUE_DEPTH)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                handoff.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce(query: str) -> None:
        try:
            for record_batch in _fetch_batches(dsn, query):
                if not put(conform(source, record_batch)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            put(exc)
        finally:
            put(_END)

    threads = [threading.Thread(target=produce, args=(q,), name="es-read", daemon=True) for q in queries]
    for t in threads:
        t.start()
    try:
        ended = 0
        while ended < len(threads):
            item = handoff.get()
            if item is _END:
                ended += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item  # type: ignore[misc]
    finally:
        stop.set()
        for t in threads:
            while t.is_alive():
                try:
                    handoff.get(timeout=0.1)
                except queue.Empty:
                    pass


class SmallReads:
    """One ADBC connection kept for a run's small batches, read in the caller's thread: opening a connection
    costs ~40 ms of CPU, more than reading a batch of a tailing run's pass (a few dozen events)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._conn: Any = None

    def read(self, source: Source | str, batch: Batch) -> Iterator[pa.RecordBatch]:
        source = as_source(source)
        queries = batch_queries(source, batch, 1)
        if not queries:
            return
        if self._conn is None:
            import adbc_driver_postgresql.dbapi as adbc

            self._conn = adbc.connect(adbc_dsn(self.dsn))
        try:
            with self._conn.cursor() as cur:
                cur.execute(no_timeouts_sql(local=True))  # in the read's own transaction, as `_cursor`
                cur.fetchall()
                cur.execute(queries[0])
                for record_batch in cur.fetch_record_batch():
                    yield conform(source, record_batch)
        finally:
            self._conn.rollback()  # ends the read's transaction: no snapshot held between passes

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


@contextmanager
def _cursor(dsn: str) -> Iterator[Any]:
    """An ADBC cursor in a transaction with es_pipeline's session settings (no timeouts)."""
    import adbc_driver_postgresql.dbapi as adbc  # here, not at the top: it imports pandas (~1.4 s)

    with adbc.connect(adbc_dsn(dsn)) as conn, conn.cursor() as cur:
        cur.execute(no_timeouts_sql(local=True))  # in the read's own transaction: holds behind a pooler too
        cur.fetchall()
        yield cur


def _fetch_batches(dsn: str, query: str) -> Iterator[pa.RecordBatch]:
    with _cursor(dsn) as cur:
        cur.execute(query)
        yield from cur.fetch_record_batch()


def _fetch_arrow(dsn: str, query: str) -> pa.Table:
    with _cursor(dsn) as cur:
        cur.execute(query)
        return cur.fetch_arrow_table()


def event_keys(dsn: str, source: Source | str) -> pa.Table:
    """(tenant, stream_id, version, recorded_at as UTC microseconds) of every event in the store (for a rebase)."""
    keys = _fetch_arrow(
        dsn, f"SELECT coalesce(e.tenant, '') AS tenant, e.stream_id, e.version, e.recorded_at "
             f"FROM {as_source(source).relation()} e")
    return pa.table({
        "tenant": keys["tenant"].cast(pa.string()),
        "stream_id": keys["stream_id"].cast(pa.string()), "version": keys["version"].cast(pa.int32()),
        "recorded_at": keys["recorded_at"].cast(UTC_MICROS).cast(pa.int64()),
    })


def keys_between(dsn: str, source: Source | str, bounds: dict[int, tuple[int, int]]) -> pa.Table:
    """(tenant, stream_id, version) of the store's events of each slice `s` with `lo <= tx_id < hi`, for
    `bounds[s] = (lo, hi)`: one index range scan per slice."""
    if not bounds:
        return pa.table({f.name: pa.array([], f.type) for f in _KEYS})
    slices = int_array(bounds)
    los, his = int_array(lo for lo, _ in bounds.values()), int_array(hi for _, hi in bounds.values())
    keys = _fetch_arrow(
        dsn, f"SELECT coalesce(e.tenant, '') AS tenant, e.stream_id, e.version "
             f"FROM unnest('{slices}'::smallint[], '{los}'::xid8[], '{his}'::xid8[]) AS w(slice, lo, hi) "
             f"CROSS JOIN LATERAL (SELECT * FROM {as_source(source).relation()} e WHERE e.slice = w.slice "
             f"AND e.tx_id >= w.lo AND e.tx_id < w.hi OFFSET 0) e")
    return pa.table([keys[f.name].cast(f.type) for f in _KEYS], schema=_KEYS)


_KEYS = pa.schema([("tenant", pa.string()), ("stream_id", pa.string()), ("version", pa.int32())])

EVENTS_ARROW_SCHEMA = READ_SCHEMA  # the lake's `events` as the source reads it (lake/events.py)


def conform(source: Source, record_batch: pa.RecordBatch) -> pa.RecordBatch:
    """A batch as read, in EVENTS_ARROW_SCHEMA: binary payloads decoded (source.payloads), types cast."""
    if source.decodes_payloads:
        record_batch = payloads.decode_column(record_batch)
    try:
        return record_batch.cast(EVENTS_ARROW_SCHEMA)  # safe: a value past the lake's type is refused, never wrapped
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise SourceNotServable(source.label, [f"a value does not fit the lake's column ({exc})"],
                                "The lake's version is an int (at most 2,147,483,647): map a narrower column, or "
                                "keep such streams out with the mapping's filter (docs/sources.md).") from None


@dataclass(frozen=True)
class Lag:
    events_behind: int  # committed events at or above the horizon (not yet extractable)
    oldest_open_tx_seconds: float  # age of the oldest open (or prepared) transaction holding H back


def count_between(
    conn: psycopg.Connection, source: Source | str, pairs: Sequence[tuple[int, int]], upper: int | None
) -> int:
    if not pairs:
        return 0
    row = conn.execute(_select(source, "count(*)", pairs, upper)).fetchone()  # type: ignore[arg-type]
    return int(row[0]) if row else 0


def first_tx_ids(conn: psycopg.Connection, source: Source | str, pairs: Sequence[tuple[int, int]], upper: int) -> int | None:
    """The smallest tx_id in the backlog: one index probe per slice."""
    if not pairs:
        return None
    table = as_source(source).relation()
    row = conn.execute(
        f"SELECT min(f.tx_id::text::bigint) FROM {_per_slice(pairs)} "  # type: ignore[arg-type]
        f"CROSS JOIN LATERAL (SELECT e.tx_id FROM {table} e WHERE e.slice = w.slice "
        f"AND e.tx_id >= w.lo AND e.tx_id < '{int(upper)}'::xid8 ORDER BY e.tx_id LIMIT 1) f"
    ).fetchone()
    return int(row[0]) if row and row[0] is not None else None


ROW_SAMPLE = 200  # backlog rows measured to estimate its width
ROW_WIDTH = (
    "octet_length(e.payload) + octet_length(e.metadata) + octet_length(e.stream_id) "
    "+ octet_length(e.stream_type) + octet_length(e.event_type) + 40"
)


def average_row_bytes(conn: psycopg.Connection, source: Source | str, pairs: Sequence[tuple[int, int]], upper: int) -> int:
    """The average width in bytes of a sample of the backlog's rows, as they travel (JSON as text).

    What the table's statistics say (`pg_table_size / reltuples`, `pg_stats.avg_width`) is the
    stored, compressed width, which can be far below what a batch reads. A guide for cutting
    batches by bytes, never a bound: a batch streams through whatever its real size.
    """
    if not pairs:
        return 1
    sample = _select(source, f"{ROW_WIDTH} AS width", pairs, upper)
    row = conn.execute(f"SELECT avg(width) FROM ({sample} LIMIT {ROW_SAMPLE}) s").fetchone()  # type: ignore[arg-type]
    return max(1, int(row[0])) if row and row[0] is not None else 1


def oldest_open_transaction_seconds(conn: psycopg.Connection) -> float:
    """Age of the oldest transaction that holds an xid (open or prepared): what holds H back."""
    row = conn.execute(
        "SELECT greatest("
        " (SELECT coalesce(extract(epoch FROM now() - min(xact_start)), 0) FROM pg_stat_activity"
        "  WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()),"
        " (SELECT coalesce(extract(epoch FROM now() - min(prepared)), 0) FROM pg_prepared_xacts))"
    ).fetchone()
    return float(row[0]) if row and row[0] is not None else 0.0


def lag(conn: psycopg.Connection, source: Source | str, slices: Sequence[int], horizon: int) -> Lag:
    behind = count_between(conn, source, [(s, horizon) for s in slices], None)
    return Lag(behind, oldest_open_transaction_seconds(conn))


@dataclass(frozen=True)
class Waiting:
    """Committed events of some slices not yet extracted: below the horizon (a run takes them now), at or above it
    (they wait for an older transaction to end), and when the oldest of them was recorded. Counts stop at `cap`."""

    extractable: int
    behind_horizon: int
    oldest_extractable_at: float | None  # `recorded_at` of the oldest extractable one, seconds since the epoch
    oldest_behind_at: float | None  # and of the oldest behind the horizon


def waiting(
    conn: psycopg.Connection, source: Source | str, pairs: Sequence[tuple[int, int]], horizon: int, *, cap: int
) -> Waiting:
    """What waits above each (slice, watermark) of `pairs`, read through the (slice, tx_id) index and counted up to
    `cap` rows: a monitor asks every few seconds, and a backfill of millions must not make each reading a scan.
    Past the cap, the oldest is each slice's first waiting event by transaction id (one index probe a slice)."""
    if not pairs:
        return Waiting(0, 0, None, None)
    inner = _select(source, "e.tx_id, e.recorded_at", pairs, None)
    row = conn.execute(  # type: ignore[call-overload]
        f"SELECT count(*) FILTER (WHERE w.tx_id < '{int(horizon)}'::xid8), "
        f"count(*) FILTER (WHERE w.tx_id >= '{int(horizon)}'::xid8), "
        f"extract(epoch FROM min(w.recorded_at) FILTER (WHERE w.tx_id < '{int(horizon)}'::xid8))::float8, "
        f"extract(epoch FROM min(w.recorded_at) FILTER (WHERE w.tx_id >= '{int(horizon)}'::xid8))::float8 "
        f"FROM ({inner} LIMIT {int(cap)}) w"
    ).fetchone()
    assert row is not None
    found = Waiting(int(row[0]), int(row[1]), row[2], row[3])
    if found.extractable + found.behind_horizon < cap:
        return found
    table = as_source(source).relation()
    first = conn.execute(  # type: ignore[call-overload]
        f"SELECT extract(epoch FROM min(f.recorded_at))::float8, min(f.tx_id::text::bigint) "
        f"FROM {_per_slice(pairs)} CROSS JOIN LATERAL "
        f"(SELECT e.recorded_at, e.tx_id FROM {table} e WHERE e.slice = w.slice AND e.tx_id >= w.lo "
        f"ORDER BY e.tx_id LIMIT 1) f"
    ).fetchone()
    oldest, lowest = (first[0], first[1]) if first else (None, None)
    if lowest is not None and int(lowest) < horizon:
        return Waiting(found.extractable, found.behind_horizon, oldest, found.oldest_behind_at)
    return Waiting(found.extractable, found.behind_horizon, found.oldest_extractable_at, oldest)
