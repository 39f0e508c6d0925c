"""Exactly-once extraction of a slice range into the Delta `events` table.

One run, for a slice range (docs/architecture.md, "The guarantee", says why each step is there):
1. lock every slice of the range (advisory locks; a second run fails fast naming the holder);
2. check that the offsets describe this Delta table (the sink binding);
3. replay any batch a crashed run left pending on these slices (same rows, same Delta txn id);
4. read the horizon H once, and the per-slice watermarks W;
5. cut the backlog `W(s) <= tx_id < H` into consecutive xid intervals of bounded size (a cut
   between two xids never splits a transaction);
6. per interval: record it as pending, read it as Arrow, append it to Delta with
   `txnAppId`/`txnVersion` (a replay of a committed batch is skipped by Delta), then advance the
   watermarks and drop the pending record in one Postgres transaction.

`build_extractor` is the one way to make an `Extractor` from `Settings` (the `events` asset, the
command line and the demo all use it); it starts Spark only if the writer or the read path needs it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from es_pipeline.errors import (
    ConfigError,
    FutureTransactionIds,
    LakeAheadOfOffsets,
    LakeStoreDiverged,
    WatermarksLeftBehind,
)
from es_pipeline.extraction import reader
from es_pipeline.extraction.offsets import Batch, OffsetSession, pending_batch_ids
from es_pipeline.extraction.rebase import rebase
from es_pipeline.extraction.slices import SliceRange, split
from es_pipeline.lake.delta import arrow_append, tables
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.events import EVENTS, with_statistics
from es_pipeline.settings import DEFAULT_BATCH_BYTES, DEFAULT_BATCH_EVENTS, WRITERS, Settings
from es_pipeline.source.mapping import Source, native
from es_pipeline.store.conninfo import resolved

log = logging.getLogger(__name__)

DEFAULT_WRITER = "delta-rs"
DEFAULT_READ_PARALLELISM = 2
PARALLEL_READ_MIN_ROWS = 20_000  # below this, a second connection costs more than it saves
EVENTS_LAKE_ARROW_SCHEMA = EVENTS.schema  # the `events` table as Arrow (lake/events.py)

CATCHUP_SLICES = 16  # slices per chunk of the first run after a rebase (extraction/rebase.py)
# A backlog this small is one batch without sampling its rows' width: the width only guides the cuts by bytes, and
# 256 rows pass the default guide (512 MB) only above 2 MB each. A tailing pass (a few dozen events) saves a query.
UNSAMPLED_BACKLOG = 256
PROGRESS_AFTER_SECONDS = 10.0  # a pass of one batch reports progress only if it took this long (tailing passes are short)
# Steps at which tests may inject a crash (`on_step` raising): the names are part of the test contract.
STEPS = ("locked", "read", "delta_committed", "offsets_committed")

SparkProvider = Callable[[], Any]  # returns a SparkSession; called only when one is needed


@dataclass
class ExtractResult:
    range_key: str
    rows: int = 0
    batches: int = 0
    replayed_batches: int = 0
    horizon: int = 0
    min_watermark: int = 0
    max_watermark: int = 0
    events_behind: int = 0
    oldest_open_tx_seconds: float = 0.0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    total_seconds: float = 0.0
    backlog: int = 0
    batch_rows: list[int] = field(default_factory=list)
    rows_by_slice: dict[int, int] = field(default_factory=dict)  # rows written from Arrow reads, by slice
    uncounted_rows: int = 0  # rows Spark's executors read over JDBC: not counted by slice
    jdbc_batches: int = 0  # batches of this pass read by Spark's executors over JDBC
    repaired_slices: int = 0  # slices whose watermarks an earlier pass left behind, moved up by this one's check

    def metadata(self) -> dict[str, int | float]:
        """Numeric metadata, plain int/float so that the Dagster UI plots it over time."""
        return {
            "dagster/row_count": int(self.rows),
            "rows": int(self.rows),
            "batches": int(self.batches),
            "replayed_batches": int(self.replayed_batches),
            "horizon": int(self.horizon),
            "min_watermark": int(self.min_watermark),
            "max_watermark": int(self.max_watermark),
            "events_behind_horizon": int(self.events_behind),
            "oldest_open_tx_seconds": round(float(self.oldest_open_tx_seconds), 3),
            "read_seconds": round(float(self.read_seconds), 3),
            "write_seconds": round(float(self.write_seconds), 3),
            "total_seconds": round(float(self.total_seconds), 3),
        }


def default_jdbc_min_rows(spark_master: str) -> int:
    """On a cluster, large batches are read by the executors; on one machine, Arrow is as fast."""
    return 0 if spark_master.startswith("local") else 500_000


def needs_spark(writer: str, jdbc_min_rows: int) -> bool:
    """Only the Spark writer and the executors' JDBC reads need a session; Arrow into delta-rs needs none."""
    return writer == "spark" or jdbc_min_rows > 0


def app_id_for(consumer: str, range_key: str) -> str:
    """Delta txn app id: one per consumer and range, whose batches the slice locks serialize."""
    return f"es_pipeline.{consumer}.{range_key}"


@dataclass
class Extractor:
    """Moves committed events of a slice range from Postgres into the Delta `events` table."""

    dsn: str
    spark: Any  # may be None with the delta-rs writer and no JDBC reads: then no JVM is started
    warehouse: Location
    schema: str = "es"  # the native store's schema, when no `source` is given
    source: Source | None = None  # where the events are (source/mapping.py); default: native(schema)
    consumer: str = ""  # default: the source's own (`Source.consumer`)
    batch_events: int = DEFAULT_BATCH_EVENTS
    batch_bytes: int = DEFAULT_BATCH_BYTES  # by the backlog's average row width (reader.average_row_bytes)
    writer: str = DEFAULT_WRITER
    read_parallelism: int = DEFAULT_READ_PARALLELISM
    # Batches of at least this many rows are read by Spark's executors over JDBC, in `jdbc_splits`
    # parallel queries; smaller ones travel as Arrow through the driver. 0 = always Arrow, the
    # default on a local master, where it measured as fast or faster (docs/decisions.md).
    jdbc_min_rows: int = 0
    jdbc_splits: int = 2
    on_step: Callable[[str, Batch | None], None] | None = None
    progress: Callable[[str], None] = log.info
    spark_seconds: float = 0.0  # what starting (or attaching to) Spark cost `build_extractor`
    _jdbc_params: dict[str, str] | None = field(default=None, init=False, repr=False)
    _table: DeltaTable | None = field(default=None, init=False, repr=False)
    _checked: bool = field(default=False, init=False, repr=False)  # `_table` as this pass's check loaded it
    _small_reads: reader.SmallReads = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.source = self.source or native(self.schema)
        self.consumer = self.consumer or self.source.consumer
        self._small_reads = reader.SmallReads(self.dsn)
        if self.writer not in WRITERS:
            raise ConfigError("ES_PIPELINE_EVENTS_WRITER", self.writer, " or ".join(WRITERS))
        if self.spark is None and self.needs_spark:
            raise ValueError("the spark writer and JDBC reads need a Spark session: pass one, or use delta-rs")

    @property
    def events_source(self) -> Source:
        assert self.source is not None  # set by __post_init__
        return self.source

    @property
    def needs_spark(self) -> bool:
        return needs_spark(self.writer, self.jdbc_min_rows)

    @property
    def events_path(self) -> str:
        return EVENTS.path(self.warehouse)

    def ensure_table(self) -> None:
        tables.ensure_table_arrow(self.events_path, EVENTS.schema, comment=f"es_pipeline: {EVENTS.comment}",
                                  properties=EVENTS.properties)
        with_statistics(self.events_path)

    def _step(self, name: str, batch: Batch | None) -> None:
        if self.on_step is not None:
            self.on_step(name, batch)

    @contextmanager
    def session(self, slice_range: SliceRange, run_id: str) -> Iterator[OffsetSession]:
        """The connections and slice locks of a run over `slice_range`; `run` opens one per call unless
        given this, which a tailing run keeps for all its passes (extraction/tail.py)."""
        try:
            with OffsetSession(self.dsn, self.consumer, run_id=run_id, label=f"events {slice_range.key}",
                               source=self.events_source) as session:
                yield session
        finally:
            self._small_reads.close()

    def run(
        self, slice_range: SliceRange, *, run_id: str = "manual", session: OffsetSession | None = None
    ) -> ExtractResult:
        """One pass: everything committed below the horizon now. With `session` (from `session()`), the
        checks of its first pass are not repeated on the next: its locks have been held in between."""
        started = time.monotonic()
        result = ExtractResult(slice_range.key)
        with nullcontext(session) if session is not None else self.session(slice_range, run_id) as session:
            app_id = app_id_for(self.consumer, slice_range.key)
            if session.sink_id is None:
                self._open(session, slice_range, app_id, result)
            else:
                # Every pass: the store is still the one the offsets count, and the lake holds no batch
                # of this range that the store does not know (a lake restored under a tailing run).
                session.check_source()
                session.check_lake_commits(app_id, self._delta().transaction_version(app_id), self.events_path)
                self._checked = True

            horizon = session.horizon()
            watermarks = session.watermarks(slice_range.slices)
            result.horizon = horizon
            pairs = [(s, w) for s, w in watermarks.items() if w < horizon]
            result.backlog = reader.count_between(session.conn, self.events_source, pairs, horizon)
            done = 0
            batches: list[tuple[Batch, int]] = []
            lower = dict(watermarks)
            for upper, n in self._cuts(session, pairs, horizon, result.backlog):
                batches.append((Batch(self.consumer, app_id, tuple(lower), tuple(lower.values()), upper), n))
                lower = {s: max(w, upper) for s, w in lower.items()}

            for planned, n in batches:
                batch = session.record_pending(planned)
                rows = self._write_batch(session, batch, result, counted=n)
                watermarks = {s: max(w, batch.upper) for s, w in watermarks.items()}
                done += rows
                if len(batches) > 1 or time.monotonic() - started >= PROGRESS_AFTER_SECONDS:
                    self._report_progress(done, result.backlog, started)
            catchup = session.catchup_slices(slice_range.slices)
            if catchup:
                result.rows += self._catch_up(session, catchup, horizon)
            # Nothing left below H: the watermark of every slice moves up to H, so that the
            # sensor's probe and the lag figures start from here next time.
            if any(w < horizon for w in watermarks.values()):
                session.commit(Batch(self.consumer, app_id, tuple(watermarks), tuple(watermarks.values()), horizon))
                for s in watermarks:
                    watermarks[s] = horizon
            if session.rebased_below is not None:
                session.clear_rebase_mark_if_passed()
            result.min_watermark = min(watermarks.values())
            result.max_watermark = max(watermarks.values())
            lag = reader.lag(session.conn, self.events_source, slice_range.slices, horizon)
            result.events_behind = lag.events_behind
            result.oldest_open_tx_seconds = lag.oldest_open_tx_seconds
        result.total_seconds = time.monotonic() - started
        return result

    def _open(self, session: OffsetSession, slice_range: SliceRange, app_id: str, result: ExtractResult) -> None:
        """A session's first pass: lock, check the store and the lake, replay what a crashed run left."""
        # A standby, or a store whose transaction ids are not the ones the offsets count (restored
        # elsewhere), is refused before anything is created: it would look caught up for ever.
        try:
            session.check_source()
        except FutureTransactionIds as exc:
            if not self._rebase_with_nothing_to_lose(exc):
                raise
            session.check_source()
        session.lock(slice_range.slices, slice_range.key)
        self._step("locked", None)
        # A table with nothing but its creation counts as new too: a run refused after creating it
        # must not make the next run take it for the lake the watermarks describe.
        table_is_new = not tables.is_delta_table(self.events_path) or tables.never_written(self.events_path)
        # One source per warehouse from the first byte: an `events` with no rows is claimed for this store and
        # consumer before anything is written (of two stores racing, one claims it, the other is refused), and one
        # bound to another refuses this run before anything is written or recorded.
        source = session.source_tag()
        self.ensure_table()
        self._table = None  # loaded afresh below: it may be another table than the last session's
        if source is not None and tables.never_written(self.events_path):
            tables.bind_to_source(self.events_path, source, self.consumer)
        bound = source is None or tables.check_source(self._delta(), self.events_path, source, self.consumer)
        # A lost, moved or recreated lake must not be taken for the one the watermarks describe.
        session.bind_sink(tables.table_id(self.events_path), self.events_path, created_now=table_is_new)
        if not bound:  # a lake of an older release, found ours by the sink's checks: bound now
            assert source is not None
            tables.bind_to_source(self.events_path, source, self.consumer)
        replays = session.pending_overlapping(slice_range.slices)
        # Postgres or the lake gone back in time (a restore, a failover): refuse before writing anything. First by
        # content, whichever app id wrote it; then every app id of the consumer whose runs our locks exclude.
        table = self._delta()  # brought up to date once: one log listing for both checks
        self._check_lake_below_watermarks(session, slice_range, table, result)
        apps = {app_id, *(p.app_id for p in replays),
                *(a for a in session.lake_commit_apps() if _app_overlaps(a, self.consumer, slice_range))}
        for app in sorted(apps):
            session.check_lake_commits(app, table.transaction_version(app), self.events_path)
        for pending in replays:
            session.lock(pending.slices, slice_range.key)  # a batch of an older range split
            self.progress(f"replaying pending batch {pending.batch_id} left by a crashed run")
            self._write_batch(session, pending, result, replay=True)
            result.replayed_batches += 1

    def _rebase_with_nothing_to_lose(self, exc: FutureTransactionIds) -> bool:
        """Rebase at once (extraction/rebase.py) where nothing can be lost or repeated: the consumer has never
        extracted anything and the lake holds no event. Whether it did."""
        if not exc.fresh or tables.holds_rows(self.events_path):
            return False
        done = rebase(self.dsn, self.events_source, self.consumer, self.events_path)
        if done is not None:
            self.progress(
                f"{self.events_source.label} holds events written by another cluster (transaction ids up to {exc.top}, "
                f"this cluster's next is {exc.next_xid}: restored before es_pipeline met it); nothing extracted yet, so "
                f"rebased at once: every event is read by key below transaction {done.rebased_below}")
        return True

    def _check_lake_below_watermarks(
        self, session: OffsetSession, slice_range: SliceRange, table: DeltaTable, result: ExtractResult
    ) -> None:
        """`LakeAheadOfOffsets` when the lake holds an event of the range at or above its slice's watermark outside
        a pending batch, in a batch PostgreSQL has no record of: a batch whose offsets PostgreSQL lost (a failover, a
        restore), by whatever app id it was written. Exempt: the restored events a rebase brings early (batch 0
        before this release, now the rebase's batch, as are a pending first run's rows) and, until the watermarks
        pass its mark, the events extracted before it. Only the files whose statistics reach the lowest watermark
        are read. Such events in batches PostgreSQL recorded as committed are watermarks left behind
        (`_move_up_left_behind`).

        The lake is read before the offsets: a batch in that version is, when they are read, either below its
        watermarks or still pending (our slice locks keep any other run from committing on these slices)."""
        slices = slice_range.slices
        marks = session.watermarks(slices)
        pending = pending_batch_ids(session.conn, self.consumer)
        floor = max(min(marks.values()), session.rebased_below or 0)
        held = table.to_pyarrow_dataset().to_table(
            columns=["slice", "tx_id", "batch_id"],
            filter=pc.field("slice").isin(list(slices)) & (pc.field("tx_id") >= floor),
        )
        if held.num_rows == 0:
            return
        # A pending batch of a first run after a rebase wrote its rows as the rebase's batch (`rows_batch_id`).
        pending = [*pending, *([session.rebase_batch] if session.rebase_batch is not None else [])]
        stray = held.filter(_above_watermarks(held, marks, pending))
        if not stray.num_rows:
            return
        # The newest batch PostgreSQL recorded as committed by a run on these slices (batch ids are one sequence).
        recorded = max((b for a, b in session.recorded_lake_commits().items()
                        if _app_overlaps(a, self.consumer, slice_range)), default=None)
        unknown = stray if recorded is None else stray.filter(
            pc.fill_null(pc.greater(stray["batch_id"], recorded), True))
        if unknown.num_rows:
            raise LakeAheadOfOffsets(
                self.events_path, self.consumer, unknown.num_rows, sorted(set(unknown["slice"].to_pylist())),
                sorted({int(b) for b in unknown["batch_id"].to_pylist() if b is not None}))
        self._move_up_left_behind(session, marks, pending, stray, table, result)

    def _move_up_left_behind(
        self, session: OffsetSession, marks: dict[int, int], pending: list[int], stray: pa.Table, table: DeltaTable,
        result: ExtractResult,
    ) -> None:
        """Watermarks left below rows of batches PostgreSQL recorded as committed: a pass of es_pipeline 0.1.0 that
        read some batches as Arrow and others by Spark's JDBC moved, for a JDBC batch, only the slices of the pass's
        earlier Arrow batches (CHANGELOG, "Unreleased"). Where the lake holds each event of the store between a slice's
        watermark and its highest such row exactly once, the watermark moves up past that row (exact: every
        transaction below it has ended). Where it holds some twice (a later pass read them again), or not the
        store's, `WatermarksLeftBehind` says so and what to do."""
        bounds = {int(s): (marks[int(s)], int(top) + 1) for s, top in zip(
            *stray.group_by("slice").aggregate([("tx_id", "max")]).select(["slice", "tx_id_max"]).columns,
            strict=True)}
        rows = table.to_pyarrow_dataset().to_table(
            columns=["tenant", "stream_id", "version", "slice", "tx_id", "batch_id"],
            filter=pc.field("slice").isin(list(bounds)) & (pc.field("tx_id") >= min(lo for lo, _ in bounds.values())))
        rows = rows.filter(_above_watermarks(rows, marks, pending))
        lake = pa.table({"tenant": tables.keys_tenant(rows), "stream_id": rows["stream_id"].cast(pa.string()),
                         "version": rows["version"].cast(pa.int32())})
        store = reader.keys_between(self.dsn, self.events_source, bounds)
        twice = lake.group_by(tables.KEY).aggregate([("version", "count")]).filter(
            pc.greater(pc.field("version_count"), 1)).num_rows
        not_in_store = lake.join(store, keys=tables.KEY, join_type="left anti").num_rows
        if twice or not_in_store or store.num_rows != lake.num_rows:
            raise WatermarksLeftBehind(
                self.events_path, self.consumer, rows.num_rows, twice, sorted(bounds),
                sorted({int(b) for b in rows["batch_id"].to_pylist() if b is not None}))
        session.move_up(bounds)
        result.repaired_slices += len(bounds)
        self.progress(
            f"events: the watermarks of {len(bounds)} slice(s) of consumer {self.consumer!r} were behind "
            f"{rows.num_rows:,} event(s) the lake holds once (left there by a pass of es_pipeline 0.1.0 that mixed "
            "Arrow and JDBC batches); moved up past them, nothing read again")

    def settle(self, session: OffsetSession, slice_range: SliceRange, run_id: str = "manual") -> ExtractResult:
        """A session's first pass without the extraction: lock, check, replay what a crashed run left pending
        (`tenant erase` runs this over every slice before it changes the store and the lake)."""
        result = ExtractResult(slice_range.key)
        self._open(session, slice_range, app_id_for(self.consumer, slice_range.key), result)
        return result

    def _delta(self, *, as_checked: bool = False) -> DeltaTable:
        """The `events` table brought up to its newest version: loaded once, then only the new log read.

        `as_checked`: the table as this pass's check of the lake loaded it a moment ago, once (a tailing pass lists
        the log once, not twice). It holds this range's batches as they are: no other process commits under its
        app id while the slices are locked; a commit of another range meanwhile is the append's commit to retry."""
        if as_checked and self._checked and self._table is not None:
            self._checked = False
            return self._table
        self._checked = False
        if self._table is None:
            self._table = DeltaTable(self.events_path)
        else:
            self._table.update_incremental()
        return self._table

    def _uses_jdbc(self, rows: int, session: OffsetSession) -> bool:
        # After a rebase the rows are checked against the lake in this process, so they come as Arrow; binary
        # payloads are decoded in this process too (source/payloads.py).
        return (self.jdbc_min_rows > 0 and rows >= self.jdbc_min_rows and session.rebased_below is None
                and not self.events_source.decodes_payloads)

    def batch_target(self, row_bytes: int) -> int:
        """Events per batch: `batch_events`, fewer where rows are wide enough to pass `batch_bytes`."""
        return max(1, min(self.batch_events, self.batch_bytes // max(row_bytes, 1)))

    def _cuts(
        self, session: OffsetSession, pairs: list[tuple[int, int]], horizon: int, backlog: int
    ) -> list[tuple[int, int]]:
        """(upper bound, rows) of consecutive xid intervals, each holding about `batch_target` rows.

        The xid span is split evenly by the backlog's density, then an interval that still counts
        over 1.5x the target is halved (counting is an index-only scan, far cheaper than reading).
        A cut lies between two xids, so one transaction's events always stay in one batch, however
        large: it then streams through as one batch (extraction/reader.py, lake/delta/arrow_append.py).
        """
        if not backlog:
            return []
        if backlog <= min(self.batch_events, UNSAMPLED_BACKLOG):
            return [(horizon, backlog)]
        target = self.batch_target(reader.average_row_bytes(session.conn, self.events_source, pairs, horizon))
        if backlog <= target:
            return [(horizon, backlog)]
        first = reader.first_tx_ids(session.conn, self.events_source, pairs, horizon)
        if first is None:
            return []
        step = max(1, math.ceil((horizon - first) * target / backlog))
        cuts: list[tuple[int, int]] = []
        lo = first
        while lo < horizon:
            hi = min(horizon, lo + step)
            n = reader.count_between(session.conn, self.events_source, [(s, max(w, lo)) for s, w in pairs], hi)
            while n > 1.5 * target and hi - lo > 1:
                hi = lo + max(1, (hi - lo) // 2)
                n = reader.count_between(session.conn, self.events_source, [(s, max(w, lo)) for s, w in pairs], hi)
            if n:
                cuts.append((hi, n))
            lo = hi
        return cuts

    def _rows(self, batch: Batch, counted: int | None, timing: list[float]) -> Iterator[pa.RecordBatch]:
        """The batch's rows as the lake stores them, streamed; `counted` keeps small batches on one connection.

        `timing[0]` adds up the seconds spent waiting for Postgres (the rest of a write is Delta's).
        """
        small = counted is not None and counted < PARALLEL_READ_MIN_ROWS
        rows = (self._small_reads.read(self.events_source, batch) if small
                else reader.stream_batch(self.dsn, self.events_source, batch, parallel=self.read_parallelism))
        while True:
            t0 = time.monotonic()
            record_batch = next(rows, None)
            timing[0] += time.monotonic() - t0
            if record_batch is None:
                break
            yield self._with_lake_columns(record_batch, batch)
        self._step("read", batch)

    def _write_batch(
        self, session: OffsetSession, batch: Batch, result: ExtractResult,
        *, counted: int | None = None, replay: bool = False,
    ) -> int:
        """Read the batch and append it to Delta as transaction (app id, batch id), then commit its offsets."""
        assert batch.batch_id is not None
        t1 = time.monotonic()
        waited = [0.0]
        # The slices this batch read rows of, counted as its own rows pass (None: not counted, every slice moves).
        # Its own: a count shared by the pass's batches would let a batch move only the slices of earlier ones.
        read: dict[int, int] | None = {}
        if counted is not None and self._uses_jdbc(counted, session):
            # Spark reads the batch itself (lazily, inside the write): `counted` was counted
            # exactly over the same deterministic bounds. Its executors count no slice.
            read = None
            self._step("read", batch)
            written = self._spark_append(self._jdbc_to_spark(batch), batch, expect_rows=counted)
            if written is None:  # a new batch Delta says it has: never skip it and go on
                session.forget_pending(batch)
                raise LakeStoreDiverged(
                    batch.app_id, self.events_path, tables.transaction_version(self.events_path, batch.app_id), None
                )
            rows, in_lake = written, written > 0
            result.uncounted_rows += written
            result.jdbc_batches += 1
        else:
            assert read is not None
            stream = _counting(self._rows(batch, counted, waited), read)
            filtered = session.rebased_below is not None and min(batch.from_watermarks) < session.rebased_below
            if filtered:
                stream = tables.without_events_in_lake(stream, self.events_path)  # see extraction/rebase.py
            sort_as = session.rows_batch_id(batch)
            if sort_as != batch.batch_id:  # a slice's first run after a rebase: its rows sort as the rebase's
                stream = _sorting_as(stream, sort_as)
            # The rows written by slice, for the run's report: the rows read, unless a rebase's filter left some out.
            written = self._append(_counting(stream, result.rows_by_slice) if filtered else stream, batch)
            if not filtered:
                for s, n in read.items():
                    result.rows_by_slice[s] = result.rows_by_slice.get(s, 0) + n
            if written is None and not replay:  # a new batch Delta says it has: never skip it and go on
                session.forget_pending(batch)
                raise LakeStoreDiverged(
                    batch.app_id, self.events_path, tables.transaction_version(self.events_path, batch.app_id), None
                )
            # A replay Delta holds already wrote nothing now; a batch left with no rows made no commit.
            rows, in_lake = written or 0, written is None or written > 0
        result.read_seconds += waited[0]
        result.write_seconds += time.monotonic() - t1 - waited[0]
        self._step("delta_committed", batch)
        # The slices it read rows of move (a slice without rows had no committed event in its interval); a replay,
        # or Spark's read, counted none: every slice moves then.
        moved = None if replay or read is None else read.keys()
        session.commit(batch, in_lake=in_lake, moved=moved)
        self._step("offsets_committed", batch)
        result.rows += rows
        result.batches += 1
        result.batch_rows.append(rows)
        return rows

    def _catch_up(self, session: OffsetSession, slices: list[int], horizon: int) -> int:
        """The first run on these slices since a rebase: the restored events above the horizon, now.

        Their transaction ids come from the old cluster and may lie far above this cluster's horizon,
        which would hold them back until the new ids caught up. Every row read is committed, and rows
        the lake holds are left out by key, so reading them early, or again later when the horizon
        passes them, brings each once; the watermarks do not move for them. They go in chunks of
        `CATCHUP_SLICES` slices, each a Delta transaction of its own, with the locks checked just before: a chunk
        written twice lands once. Its app id names the cluster, the mark and the slices, so that each move of the
        store (A to B, later B to C) catches up anew rather than finding its chunks done by the last move's.
        """
        below = session.rebased_below
        rows = 0
        for i in range(0, len(slices), CATCHUP_SLICES):
            chunk = slices[i:i + CATCHUP_SLICES]
            if below is not None and horizon < below:
                app = f"es_pipeline.{self.consumer}.rebase.{session.cluster}.{below}.{chunk[0]:04d}-{chunk[-1]:04d}"
                span = Batch(self.consumer, app, tuple(chunk), (horizon,) * len(chunk), below, 0)
                stream = tables.without_events_in_lake(self._rows(span, None, [0.0]), self.events_path)
                if session.rebase_batch is not None:  # sorting with the first runs' rows (`rows_batch_id`)
                    stream = _sorting_as(stream, session.rebase_batch)
                rows += self._append(stream, span, before_commit=partial(session.verify_locks, chunk)) or 0
            session.catchup_done(chunk)
        if rows:
            self.progress(f"rebase: {rows:,} restored events above the horizon brought for {len(slices)} slices")
        return rows

    def _append(
        self, stream: Iterator[pa.RecordBatch], batch: Batch, *, before_commit: Callable[[], None] | None = None
    ) -> int | None:
        """Append as Delta transaction (app id, batch id): rows written, or None if Delta holds it already.

        The stream is closed however this ends, so that its reading threads and connections stop at once.
        """
        assert batch.batch_id is not None
        try:
            if self.writer != "spark":
                return arrow_append.append_batches(
                    stream, EVENTS_LAKE_ARROW_SCHEMA, self.events_path, app_id=batch.app_id, version=batch.batch_id,
                    before_commit=before_commit, table=self._delta(as_checked=True),
                )
            done = tables.transaction_version(self.events_path, batch.app_id)
            if done is not None and done >= batch.batch_id:
                return None
            table = pa.Table.from_batches(list(stream), EVENTS_LAKE_ARROW_SCHEMA)  # Spark takes a whole table
            if table.num_rows == 0:
                return 0
            return self._spark_append(self.spark.createDataFrame(table), batch, expect_rows=table.num_rows,
                                      before_commit=before_commit)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    def _spark_append(
        self, df: Any, batch: Batch, *, expect_rows: int, before_commit: Callable[[], None] | None = None
    ) -> int | None:
        """Spark writes the batch's Parquet files (on a cluster, its executors), delta-rs commits them as
        transaction (app id, batch id): rows committed, or None if Delta holds the batch already (then the
        files are left to VACUUM; callers check for a replay before reading, so this is the rare divergence).

        Spark never commits to `events` itself: its S3 log store checks, then writes, which another
        process's commit can slip between (docs/decisions.md, "One committer engine per table")."""
        assert batch.batch_id is not None
        folder = arrow_append.new_folder(f"spark-batch-{batch.batch_id}")
        self.spark.conf.set("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")  # as delta-rs writes them
        (df.select(*EVENTS_LAKE_ARROW_SCHEMA.names).write.mode("error").option("compression", "snappy")
         .parquet(f"{self.events_path}/{folder}"))
        return arrow_append.commit_parquet_folder(
            self.events_path, EVENTS_LAKE_ARROW_SCHEMA, folder, app_id=batch.app_id, version=batch.batch_id,
            expect_rows=expect_rows, before_commit=before_commit,
        )

    @staticmethod
    def _with_lake_columns(rows: pa.RecordBatch, batch: Batch) -> pa.RecordBatch:
        """The two columns the lake adds: the event's UTC day, and the batch that brought it."""
        added = {"event_date": pc.cast(rows["recorded_at"], pa.date32()),
                 "batch_id": pa.repeat(pa.scalar(batch.batch_id, pa.int64()), rows.num_rows)}
        return pa.RecordBatch.from_arrays(
            [added[f.name] if f.name in added else rows[f.name] for f in EVENTS_LAKE_ARROW_SCHEMA],
            schema=EVENTS_LAKE_ARROW_SCHEMA,
        )

    def _jdbc_to_spark(self, batch: Batch) -> Any:
        from pyspark.sql import functions as F

        if self._jdbc_params is None:  # what libpq connected with, once per extractor (a connection each time)
            self._jdbc_params = resolved(self.dsn)
        df = reader.jdbc_frame(self.spark, self.dsn, self.events_source, batch, splits=self.jdbc_splits,
                               params=self._jdbc_params)
        return df.withColumn("event_date", F.to_date("recorded_at")).withColumn(
            "batch_id", F.lit(batch.batch_id).cast("bigint")
        )

    def _report_progress(self, done: int, total: int, started: float) -> None:
        elapsed = max(time.monotonic() - started, 1e-6)
        rate = done / elapsed
        eta = (total - done) / rate if rate > 0 else float("inf")
        pct = 100.0 * done / total if total else 100.0
        self.progress(f"events: {done:,}/{total:,} ({pct:.0f}%), {rate:,.0f} events/s, ETA {eta:.0f} s")


def _app_overlaps(app_id: str, consumer: str, slice_range: SliceRange) -> bool:
    """Whether `app_id` is a range's of `consumer` (`app_id_for`) that shares a slice with `slice_range`: its runs need
    a lock that ours holds, so its record and the lake's cannot move while we compare them."""
    prefix = app_id_for(consumer, "")
    if not app_id.startswith(prefix):
        return False
    try:
        other = SliceRange.from_key(app_id[len(prefix):])
    except ValueError:
        return False
    return other.lo <= slice_range.hi and slice_range.lo <= other.hi


def _above_watermarks(rows: pa.Table, marks: dict[int, int], pending: list[int]) -> pa.Array:
    """Which of the lake's `rows` (slice, tx_id, batch_id) lie at or above their slice's watermark outside a pending
    batch (batch 0 is the restored events a rebase brought early)."""
    by_slice = pa.array([marks.get(s, 0) for s in range(max(marks) + 1)], pa.int64())
    above = pc.greater_equal(rows["tx_id"], pc.take(by_slice, rows["slice"]))
    known = pc.or_(pc.equal(rows["batch_id"], 0), pc.is_in(rows["batch_id"], pa.array(sorted(pending), pa.int64())))
    return pc.and_(above, pc.invert(pc.fill_null(known, False)))


def _sorting_as(rows: Iterator[pa.RecordBatch], batch_id: int) -> Iterator[pa.RecordBatch]:
    """`rows` with `batch_id` as the batch they sort in (`OffsetSession.rows_batch_id`); closing this closes `rows`."""
    column = EVENTS_LAKE_ARROW_SCHEMA.get_field_index("batch_id")
    try:
        for record_batch in rows:
            arrays = list(record_batch.columns)
            arrays[column] = pa.repeat(pa.scalar(batch_id, pa.int64()), record_batch.num_rows)
            yield pa.RecordBatch.from_arrays(arrays, schema=record_batch.schema)
    finally:
        close = getattr(rows, "close", None)
        if close is not None:
            close()


def _counting(rows: Iterator[pa.RecordBatch], by_slice: dict[int, int]) -> Iterator[pa.RecordBatch]:
    """`rows`, passed on, counted by slice into `by_slice`; closing this closes `rows` (its reads stop)."""
    try:
        for record_batch in rows:
            counts = pc.value_counts(record_batch["slice"])
            for s, n in zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist(), strict=True):
                by_slice[s] = by_slice.get(s, 0) + n
            yield record_batch
    finally:
        close = getattr(rows, "close", None)
        if close is not None:
            close()


def build_extractor(
    settings: Settings, spark: SparkProvider, *, progress: Callable[[str], None] = log.info
) -> Extractor:
    """The `Extractor` that `settings` describe: store, schema, lake, writer, read path.

    `spark` is called only when the writer or the read path needs a session (the Spark writer, or a
    cluster master, whose executors read large batches over JDBC): with the defaults no JVM starts.
    """
    jdbc_min_rows = (default_jdbc_min_rows(settings.spark_master) if settings.jdbc_min_rows is None
                     else settings.jdbc_min_rows)
    session, seconds = None, 0.0
    if needs_spark(settings.events_writer, jdbc_min_rows):
        t0 = time.monotonic()
        session = spark()
        seconds = time.monotonic() - t0
    return Extractor(
        dsn=settings.pg_dsn,
        spark=session,
        warehouse=settings.warehouse,
        schema=settings.schema,
        source=settings.source,
        writer=settings.events_writer,
        batch_events=settings.batch_events,
        batch_bytes=settings.batch_bytes,
        jdbc_min_rows=jdbc_min_rows,
        progress=progress,
        spark_seconds=seconds,
    )


def extract_ranges(
    settings: Settings, range_keys: Sequence[str] | None, spark: SparkProvider, *,
    run_id: str, progress: Callable[[str], None] = log.info,
) -> Iterator[ExtractResult]:
    """Extract the ranges named by their keys (default: every range of `settings`), one after another."""
    ranges = [SliceRange.from_key(k) for k in range_keys] if range_keys else split(settings.slice_ranges)
    extractor = build_extractor(settings, spark, progress=progress)
    for r in ranges:
        yield extractor.run(r, run_id=run_id)
