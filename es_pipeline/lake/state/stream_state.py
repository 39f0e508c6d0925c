"""`stream_state`: one row per stream, its state folded by its type's reducer from `events`, incrementally.

Each update folds only what is new since the last one: the rows that the Delta commits of `events` after
the last processed table version added (Delta's change data feed, so the cost follows the increment, not
the table), onto the previous state of the streams they touch, in version order (lake/state/fold.py: gaps wait,
`parked`; a type without a reducer keeps versions alone). The `events` version folded is committed
atomically with the state, as the commit's Delta transaction id (`txnAppId`/`txnVersion`), so a crash
or a retry never folds an event twice; the commit happens in the table's turn (lake/kernel/turn.py).

Three paths, one fold, the same txn ids, so each goes on from what another committed:
- a small increment (up to `feed.SMALL_INCREMENT` new events): folded in this process, merged by delta-rs;
- a first build of an `events` table that fits (lake/state/whole_fold.py): forked processes, written by delta-rs;
- Spark: the rows partitioned by stream and sorted, folded by `fold_partitions` on the Python workers
  (`mapInArrow`: plain Python per event, Arrow in and out), merged by Spark; a larger increment, a reducer
  added, bumped or removed (that stream type rebuilt alone), a change feed vacuumed away. Onto nothing (a first
  build), a declared reducer's streams are Spark's own aggregations instead (lake/state/declared_spark.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake

from es_pipeline.domain import Domain
from es_pipeline.errors import ReducerError
from es_pipeline.lake.delta import current, pieces, tables
from es_pipeline.lake.delta.definition import Table
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel import position, runner
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.kernel.feed import Feed
from es_pipeline.lake.kernel.position import REVISION_SLOTS, Position, next_txn_version, txn_version
from es_pipeline.lake.kernel.projection import Increment, Kind
from es_pipeline.lake.kernel.result import Result
from es_pipeline.lake.kernel.turn import Turn
from es_pipeline.lake.state import declared_build, declared_spark, history, rebuild, typed_state, whole_fold
from es_pipeline.lake.state.fold import (
    HISTORY_COLUMNS,
    LATER_COLUMNS,
    STATE_SCHEMA,
    Written,
    arrow_result,
    arrow_updates,
    read_columns,
    state_result,
    with_schema_versions,
)
from es_pipeline.lake.state.state_table import (
    KEY,
    STREAM_STATE,
    app_id,
    fold_onto,
    follow_dead_letters,
    spark_columns,
    spark_fold,
    without_prior,
)
from es_pipeline.source import payloads

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

_HELD = ("tenant", "stream_id", "stream_type", "quarantined")  # a quarantined row, as `_dead_letters` lists it

_PARKED_SCHEMA = "ARRAY<STRUCT<version: INT, event_type: STRING, payload: STRING, recorded_at: TIMESTAMP>>"


def folded_version(warehouse: Location) -> tuple[int, int] | None:
    """(stream_state's Delta version, the version of the `events` table now in the lake it has folded up to),
    read from one version of its log; None before its first update from that `events`."""
    state_path = tables.table_path(warehouse, "stream_state")
    events_path = EVENTS.path(warehouse)
    if not tables.is_delta_table(state_path) or not tables.is_delta_table(events_path):
        return None
    table = DeltaTable(state_path)
    read = table.transaction_version(app_id(tables.table_id(events_path)))
    return None if read is None else (int(table.version()), int(read) // REVISION_SLOTS)


def update_stream_state(
    engine: Engine, warehouse: Location, *, domain: Domain, skip_unknown: bool = False, store_dsn: str | None = None,
    rebuilds: str = "beside",
) -> Result:
    """Fold the events of the `events` commits since the last update onto `stream_state` (module docstring), by the
    kernel's runner, where `engine` says (a small increment and a first build within the engine rule's bound are
    folded without a JVM); with `store_dsn`, one update at a time. Then, out of the table's turn, every stream
    type to rebuild is rebuilt beside it and swapped in (lake/state/rebuild.py), unless `rebuilds` is "hold".
    `NoEventsYet` before `events` exists."""
    result = runner.update(_StreamState(warehouse, domain, skip_unknown), engine, warehouse, store_dsn=store_dsn)
    swapped = rebuild.run_pending(engine, warehouse, domain, store_dsn, skip_unknown=skip_unknown,
                                  hold=rebuilds == "hold")
    if not swapped:
        return result
    return result.with_figures(rebuilt_types=", ".join(swapped), rebuilding_types=", ".join(
        t for t in result.listed("rebuilding_types") if t not in swapped) or "-")


def retry(warehouse: Location, domain: Domain, *, store_dsn: str | None = None,
          streams: Collection[str] = ()) -> Result | None:
    """Refold the quarantined streams now (those of `streams` only, where named) with the code as deployed, by the
    kernel's runner (`runner.retry`): a stream that folds leaves quarantine (and `_dead_letters`) in this commit, its
    state the fold of its events. Every update does this for every quarantined stream; this is for a table with no
    new events. None: the table is behind `events` (or not built): an update does it, with the new events."""
    return runner.retry(_StreamState(warehouse, domain, False, only=tuple(streams)), warehouse, store_dsn=store_dsn)


def with_typed_state(warehouse: Location, domain: Domain, result: Result, written: Written | None = None,
                     held: pa.Table | None = None) -> Result:
    """`result`, once the typed state tables of `domain` follow `stream_state` (lake/state/typed_state.py: from
    `written`, the commit this process just made, where it made one), and `_dead_letters` its quarantined rows
    (`follow_dead_letters`); in the table's turn. Also after an update that found nothing new: a table a crash left
    behind `stream_state` catches up."""
    rows = typed_state.update(warehouse, domain, written)
    follow_dead_letters(warehouse, held)
    return result.with_figures(**{f"typed_rows/{name}": n for name, n in sorted(rows.items())}) if rows else result


def small_increment(
    warehouse: Location, domain: Domain, skip_unknown: bool, turn: Turn, events_feed: Feed | None = None
) -> Result | None:
    """The increment folded here and merged by delta-rs (up to `feed.SMALL_INCREMENT` new events), by the kernel's
    runner, the typed state tables following; None: Spark's to do (a first build, a reducer added, bumped or removed,
    a larger increment, a change feed vacuumed away). `events_feed`: `events`' change feed shared with other
    increments (else read here)."""
    return runner.increment(_StreamState(warehouse, domain, skip_unknown), warehouse, turn, events_feed)


@dataclass(frozen=True)
class _StreamState(Kind):
    """`stream_state` as a kind of the projection kernel (lake/kernel/projection.py): its increment, its first build
    in process (`_first_build`) and its update on Spark (`_update_with_spark`). Its position keeps the reducers'
    revisions in its slots (lake/kernel/position.py `txn_version`)."""

    warehouse: Location
    domain: Domain
    skip_unknown: bool
    only: tuple[str, ...] = ()  # a retry of these quarantined streams alone (`retry`); () every one
    table: Table = STREAM_STATE
    name: ClassVar[str] = STREAM_STATE.name
    slots: ClassVar[int] = REVISION_SLOTS

    @property
    def columns(self) -> list[str]:
        return read_columns(self.domain)

    def ready(self, path: str, target: DeltaTable, events_id: str) -> DeltaTable | None:
        if not tables.has_columns(target, KEY):
            return None  # a table made before tenants: Spark adds the column
        if not tables.has_columns(target, LATER_COLUMNS):  # a table of a release before state history, or quarantine
            tables.add_missing_columns(path, STATE_SCHEMA)
            target = DeltaTable(path)
        return None if current.has_deletion_vectors(target) else target  # its files alone are not its rows

    def up_to_date(self, target: DeltaTable, position: Position, now: int) -> Result:
        # Nothing new (a stream type to rebuild is the rebuild's to do: lake/state/rebuild.py).
        assert position.events_version is not None
        return with_typed_state(self.warehouse, self.domain, state_result(now, position.events_version, 0, 0, 0, 0))

    def txn(self, increment: Increment) -> int:
        return txn_version(increment.now, self.domain.folds)

    def fold(self, rows: pa.Table, increment: Increment) -> _StateFold:
        state, warehouse, read = increment.target, increment.warehouse, increment.position.read
        assert read is not None
        new = with_schema_versions(payloads.for_reducers(tables.tenant_filled(rows)), self.domain)
        # Read once, whole, and filtered here: pyarrow's pushdown fails on the string_view statistics delta-rs writes.
        whole = current.files(increment.path, state).to_table()
        quarantined = whole.filter(pc.is_valid(whole["quarantined"])).select(list(_HELD)) \
            if "quarantined" in whole.column_names else pa.table({c: pa.array([], pa.string()) for c in _HELD})
        kinds = whole.select(["stream_type", "revision"]).group_by(["stream_type", "revision"]).aggregate([])
        # A stream type to rebuild (its reducer changed, its history table unbound) is left as it is, its events with
        # it, until its rebuild beside swaps it in (lake/state/rebuild.py); every other type is folded now.
        held = rebuild.pending(warehouse, self.domain, zip(kinds["stream_type"].to_pylist(),
                                                           kinds["revision"].to_pylist(), strict=True),
                               increment.feed.table_id, read, state)
        if held:
            new, whole = rebuild.without(new, held), rebuild.without(whole, held)
        if self.only:  # a retry of some quarantined streams: the others' parked rows are not refolded now
            whole = whole.filter(pc.or_(pc.is_null(whole["parked"]), pc.is_in(whole["stream_id"],
                                                                               pa.array(self.only, pa.string()))))
        out, prior = fold_onto(whole, new, self.domain, self.skip_unknown)
        return _StateFold(self.domain, increment, out, prior, held, quarantined)

    def build_here(self, warehouse: Location, turn: Turn, engine: Engine) -> Result | None:
        done = _first_build(warehouse, self.domain, self.skip_unknown, turn)
        return None if done is None else with_typed_state(warehouse, self.domain, done)

    def update_on_spark(self, spark: SparkSession, warehouse: Location, turn: Turn) -> Result:
        try:
            done = _update_with_spark(spark, warehouse, self.domain, self.skip_unknown, turn)
        except tables.spark_errors() as exc:
            if not tables.change_feed_gone(exc):
                raise
            # The files of the commits since the last update were vacuumed (it lagged past the retention):
            # fold every event instead; the fold skips versions a stream's state already has.
            done = _update_with_spark(spark, warehouse, self.domain, self.skip_unknown, turn, whole=True)
        return with_typed_state(warehouse, self.domain, done)


@dataclass(frozen=True)
class _StateFold:
    """An increment of `stream_state` folded: merged by delta-rs with the position and the types held back, then
    the history tables (lake/state/history.py)."""

    domain: Domain
    increment: Increment
    out: pa.Table
    prior: pa.Table
    held: list[str]
    quarantined: pa.Table  # the table's quarantined rows before this commit (`_HELD`'s columns)

    def held_after(self, updates: pa.Table) -> pa.Table:
        """The table's quarantined rows once `updates` are merged: known without reading it again."""
        keys = lambda t: pc.binary_join_element_wise(pc.fill_null(t["tenant"], ""), t["stream_id"], "\x00")  # noqa: E731
        kept = self.quarantined.filter(pc.invert(pc.is_in(keys(self.quarantined), keys(updates))))
        new = updates.filter(pc.is_valid(updates["quarantined"])).select(list(_HELD))
        return pa.concat_tables([kept.cast(new.schema), new])

    def commit(self, txn: int) -> Result:
        state, step, held = self.increment.target, self.increment, self.held
        read = step.position.read
        assert read is not None
        updates = arrow_updates(self.out)
        before = int(state.version())
        # With the position, the types held back from now on: they stay pending until swapped (lake/state/rebuild.py).
        props = position.marks([(step.position.app_id, txn), *rebuild.marks(state, step.feed.table_id, held, read)])
        # A retry (`retry`: the position it holds, recorded again) writes the history tables first: they record the
        # same txn before and after, so one left behind by a crash would look up to date; written first, a crash
        # leaves rows the next retry writes again (the MERGE by key), never a missing part.
        retrying = txn == read
        kept = history.write_arrow(step.warehouse, self.domain, self.out, step.feed.table_id, txn, whole=(),
                                   skip=held) if retrying else {}
        if updates.num_rows:
            state.merge(updates, predicate=" AND ".join(f"t.{k} = u.{k}" for k in KEY), source_alias="u",
                        target_alias="t", commit_properties=props) \
                .when_matched_update_all().when_not_matched_insert_all().execute()
        else:  # only events of a type held back (delta-rs commits no MERGE without rows): the position recorded alone
            position.record(state, props)
        if not retrying:
            kept = history.write_arrow(step.warehouse, self.domain, self.out, step.feed.table_id, txn, whole=(),
                                       skip=held)
        result = arrow_result(self.out, step.now, step.previous, history_rows=kept, held_types=held)
        if not typed_state.typed_tables(self.domain):
            follow_dead_letters(step.warehouse, self.held_after(updates))
            return result  # no typed table follows the commit: which streams are new is not needed
        prior = pc.binary_join_element_wise(self.prior["tenant"], self.prior["stream_id"], "\x00")
        inserted = pc.invert(pc.is_in(pc.binary_join_element_wise(updates["tenant"], updates["stream_id"], "\x00"),
                                      prior))
        return with_typed_state(step.warehouse, self.domain, result,
                                Written(before, int(state.version()), updates, inserted), self.held_after(updates))


def _first_build(warehouse: Location, domain: Domain, skip_unknown: bool, turn: Turn) -> Result | None:
    """The first build from this `events` (a rebuild where the table was folded from another) folded by this
    machine's cores and written by delta-rs, replacing any rows; None: Spark's to do."""
    events_path = EVENTS.path(warehouse)
    state_path = STREAM_STATE.path(warehouse)
    if not tables.is_delta_table(events_path):
        return None
    app = app_id(tables.table_id(events_path))
    if tables.is_delta_table(state_path):
        state = DeltaTable(state_path)
        if state.transaction_version(app) is not None:
            return None  # built from this `events` already: an increment, or a revision rebuild, is Spark's or the small path's
        if current.has_deletion_vectors(state):
            return None  # delta-rs does not write such a table: Spark rebuilds it
    folded = whole_fold.fold_table(events_path, domain, skip_unknown)
    if folded is None:
        return None
    out, now, built = folded
    updates = arrow_updates(out)
    position.fence_older(state_path, [(STREAM_STATE.app_id, position.FENCE)])
    STREAM_STATE.ensure_arrow(warehouse, typed_state.state_properties(domain))
    turn.confirm(state_path, app, None)
    version = txn_version(now, domain.folds)
    write_deltalake(state_path, updates.cast(STATE_SCHEMA), mode="overwrite",
                    commit_properties=position.commit_properties(app, version))
    kept = history.write_built(warehouse, domain, built, tables.table_id(events_path), version)
    return arrow_result(out, now, -1, history_rows=kept)


def _update_with_spark(
    spark: SparkSession, warehouse: Location, domain: Domain, skip_unknown: bool, turn: Turn, *, whole: bool = False
) -> Result:
    from pyspark.sql import functions as F

    events_path = EVENTS.path(warehouse)
    state_path = STREAM_STATE.ensure(spark, warehouse, typed_state.state_properties(domain))
    if not tables.has_columns(state_path, ["tenant"]):  # made before tenants: every row is of no tenant ('')
        spark.sql(f"ALTER TABLE delta.`{state_path}` ADD COLUMNS (tenant STRING)")
        spark.sql(f"UPDATE delta.`{state_path}` SET tenant = '' WHERE tenant IS NULL")
    if not tables.has_columns(state_path, HISTORY_COLUMNS):  # made before state history
        spark.sql(f"ALTER TABLE delta.`{state_path}` ADD COLUMNS (history_from INT, history_at TIMESTAMP)")
    if not tables.has_columns(state_path, ["quarantined"]):  # made before quarantine (docs/decisions/0051)
        spark.sql(f"ALTER TABLE delta.`{state_path}` ADD COLUMNS (quarantined STRING)")
    now = tables.table_version(spark, events_path)
    events_id = tables.table_id(events_path)
    app = app_id(events_id)
    read = tables.transaction_version(state_path, app)
    prev = -1 if read is None else read // REVISION_SLOTS
    # Not folded from this `events` (a first build, or the lake's `events` replaced): folded whole, onto nothing,
    # and the table overwritten, so that no row of another `events` stays.
    state = tables.read(spark, state_path) if read is not None else tables.read(spark, state_path).limit(0)
    # A stream type to rebuild is left as it is, its events with it, until its rebuild beside swaps it in.
    live = DeltaTable(state_path)
    held = [] if read is None else rebuild.pending(
        warehouse, domain, state.select("stream_type", "revision").distinct().collect(), events_id, read, live)
    cols = spark_columns(domain)
    native = None
    started = time.monotonic()  # the fold's time: a native build computes its aggregation from here
    if prev < 0 or (whole and prev < now):
        events = tables.read(spark, events_path, version=now)
        new = events.select(*cols)
        declared = declared_build.native_types(domain)
        if read is None and declared:  # onto nothing: the declared types aggregated by Spark (lake/state/declared_spark.py)
            native = declared_spark.build(events, declared)
            try:
                new = native.python_events(
                    new, sorted(declared), lambda: current.exact_row_count(DeltaTable(events_path, version=now)))
            except BaseException:
                native.unpersist()
                raise
    elif prev < now:
        new = tables.rows_added(spark, events_path, prev, now).select(*cols)
    else:
        return state_result(now, prev, 0, 0, 0, 0, engine="spark")
    if new is None:  # every event built by Spark's aggregation: nothing for the Python workers to fold
        assert native is not None
        folded = native.out  # over the aggregation, cached
    else:
        prior = state
        if held:
            new, prior = new.where(~F.col("stream_type").isin(held)), state.where(~F.col("stream_type").isin(held))
        parked = (
            prior.where("parked IS NOT NULL")
            .select("tenant", "stream_id", "stream_type", F.explode(F.from_json("parked", _PARKED_SCHEMA)).alias("p"))
            .select("stream_id", "stream_type", "p.version", "p.event_type", "p.payload", "p.recorded_at", "tenant")
        )
        todo = new.unionByName(parked)
        touched = todo.select(*KEY).distinct()
        # The prior row of each touched stream travels with its events, marked and sorted first: its
        # state in `payload`, its version and last event time in theirs.
        prior_rows = prior.join(touched, list(KEY), "left_semi").select(
            "stream_id", "stream_type", "version", F.lit(None).cast("string").alias("event_type"),
            F.col("state").alias("payload"), F.col("last_event_at").alias("recorded_at"), "tenant",
            F.col("skipped").alias("prior_skipped"), F.lit(True).alias("is_prior"),
            F.col("history_from").alias("prior_history_from"), F.col("history_at").alias("prior_history_at"),
            F.col("quarantined").alias("prior_quarantined"),
        )
        folded = spark_fold(without_prior(todo).unionByName(prior_rows), domain, skip_unknown)
        if native is not None:
            folded = native.out.unionByName(folded)
        folded = folded.cache()
    try:
        # One action computes the fold (cached) and its figures; the first error, if any, is in it.
        stats = native.figures() if new is None and native is not None else folded.agg(
            F.count("*").alias("streams"), F.sum(F.when(F.col("parked").isNotNull(), 1).otherwise(0)).alias("parked"),
            F.sum("skipped").alias("skipped"), F.sum("folded").alias("folded"), F.min("error").alias("error"),
            F.sum(F.when(F.col("revision") == 0, 1).otherwise(0)).alias("without_reducer"),
            F.sum(F.when(F.col("quarantined").isNotNull(), 1).otherwise(0)).alias("quarantined"),
        ).first()
        if stats["error"] is not None:
            stream_id, version, event_type, reason = json.loads(stats["error"])
            raise ReducerError(stream_id, version, event_type, reason)
        n_events = stats["folded"] or 0
        log.info("stream_state on Spark: %s events folded over %s streams in %.1f s (the shuffle by stream, the sort, "
                 "the fold)", f"{int(n_events):,}", f"{int(stats['streams'] or 0):,}", time.monotonic() - started)
        started = time.monotonic()
        updates = folded.drop("error", "folded", "history").withColumn("updated_at", F.current_timestamp())
        turn.confirm(state_path, app, read)
        version = next_txn_version(now, domain.folds, read)
        if read is not None:  # the types held back from now on, before the commit that passes their events
            rebuild.record(lambda: spark, state_path, rebuild.marks(live, events_id, held, read))
        # The history tables first: `folded` reads `stream_state`, and Spark recomputes it once that is written.
        kept = history.write_spark(spark, warehouse, domain, folded, events_id, version,
                                   whole=() if read is not None else list(domain.folds), skip=held)
        if read is None:
            position.fence_older(state_path, [(STREAM_STATE.app_id, position.FENCE)])
            (updates.select(*STATE_SCHEMA.names).write.format("delta").mode("overwrite")
             .option("txnAppId", app).option("txnVersion", str(version)).save(state_path))
        elif not stats["streams"] and not current.has_deletion_vectors(DeltaTable(state_path)):
            # Only events of a type held back: the position recorded alone (as the small path does).
            position.record(DeltaTable(state_path), position.commit_properties(app, version))
        else:
            tables.merge_by_key(spark, state_path, updates, KEY, app_id=app, version=version)
        log.info("stream_state on Spark: the rows written in %.1f s (%s)", time.monotonic() - started,
                 "a new table" if read is None else "MERGE")
    finally:
        folded.unpersist()
        if native is not None:
            native.unpersist()
    return state_result(now, prev, int(n_events), int(stats["streams"] or 0), int(stats["parked"] or 0),
                        int(stats["skipped"] or 0), int(stats["without_reducer"] or 0), engine="spark",
                        history_rows=kept, held_types=held, quarantined=int(stats["quarantined"] or 0))


@dataclass(frozen=True)
class VersionsOff:
    """`stream_state` against the `events` version it folded: streams whose folded version is not their last
    event's (none parked), a few of them, and that `events` version (None: not built yet)."""

    streams: int
    examples: list[str]
    events_version: int | None
    engine: str = "local"  # what compared: this process (Arrow) or "spark"
    quarantined: int = 0  # streams held at their last good state (docs/decisions/0051): left out, like parked ones


def versions_off(warehouse: Location, engine: Engine) -> VersionsOff:
    """`stream_state` against the `events` version it folded: in this process where `versions_off_small` can,
    else on Spark (the engine rule, or deletion vectors in `stream_state`)."""
    small = versions_off_small(warehouse, engine)
    return small if small is not None else _versions_off_on_spark(warehouse, engine.session())


def _versions_off_on_spark(warehouse: Location, spark: SparkSession) -> VersionsOff:
    from pyspark.sql import functions as F

    folded = folded_version(warehouse)
    if folded is None:
        return VersionsOff(0, [], None)
    state_version, events_version = folded
    state_path = tables.table_path(warehouse, "stream_state")
    events = tables.with_tenant(tables.read(spark, EVENTS.path(warehouse), version=events_version)) \
        .groupBy(*KEY, "stream_type").agg({"version": "max"}).withColumnRenamed("max(version)", "max_version")
    state = tables.read(spark, state_path, version=state_version)
    # A stream type held back for its rebuild beside stream_state (lake/state/rebuild.py) is behind until its swap.
    types = {r[0] for r in state.select("stream_type").union(events.select("stream_type")).distinct().collect()}
    held = rebuild.held_back(DeltaTable(state_path, version=state_version),
                             tables.table_id(EVENTS.path(warehouse)), types)
    if held:
        state, events = state.where(~F.col("stream_type").isin(held)), events.where(~F.col("stream_type").isin(held))
    events = events.drop("stream_type")
    bad = state.join(events, list(KEY), "full_outer").where(
        "parked IS NULL AND (version IS NULL OR max_version IS NULL OR version <> max_version)")
    quarantined = state.where("quarantined IS NOT NULL").count() if "quarantined" in state.columns else 0
    return VersionsOff(int(bad.count()), [r["stream_id"] for r in bad.limit(5).collect()], events_version,
                       engine="spark", quarantined=int(quarantined))


def versions_off_small(warehouse: Location, engine: Engine) -> VersionsOff | None:
    """The check of `stream_state` without a JVM (the snapshots' write-back waits on it), `events` read in bounded
    pieces (each stream's last version, a million events at a time): None where Spark should do it (the engine
    rule, `on_spark`, or deletion vectors in `stream_state`, which its files alone do not honour). The
    stream types held back for a rebuild beside the table are left out (behind until their swap)."""
    state_path = tables.table_path(warehouse, "stream_state")
    folded = folded_version(warehouse)
    if folded is None:
        return VersionsOff(0, [], None)
    state_version, events_version = folded
    events = DeltaTable(EVENTS.path(warehouse), version=events_version)
    state = DeltaTable(state_path, version=state_version)
    if current.has_deletion_vectors(state) or engine.on_spark(lambda: tables.files_bytes(events)):
        return None
    keys = list(KEY)
    last: pa.Table | None = None
    grouped = [*keys, "stream_type"]
    for rows in pieces.chunks(pieces.batches(EVENTS.path(warehouse), events, [*grouped, "version"])):
        if "tenant" not in rows.column_names:  # a lake of a release before tenants
            rows = rows.append_column("tenant", pa.nulls(rows.num_rows, pa.string()))
        step = tables.tenant_filled(rows).group_by(grouped).aggregate([("version", "max")]) \
            .rename_columns([*grouped, "max_version"])
        last = step if last is None else pa.concat_tables([last, step]).group_by(grouped).aggregate(
            [("max_version", "max")]).rename_columns([*grouped, "max_version"])
    if last is None:
        last = pa.table({**{k: pa.array([], pa.string()) for k in grouped}, "max_version": pa.array([], pa.int32())})
    held_column = ["quarantined"] if tables.has_columns(state, ["quarantined"]) else []
    rows = current.files(state_path, state).to_table(columns=[*keys, "stream_type", "version", "parked",
                                                              *held_column])
    quarantined = int(pc.sum(pc.is_valid(rows["quarantined"])).as_py() or 0) if held_column else 0
    rows = rows.drop_columns(held_column)
    rows = tables.tenant_filled(rows) if "tenant" in keys else rows
    # A stream type held back for its rebuild beside (lake/state/rebuild.py) is behind by design until its swap.
    held = rebuild.held_back(state, str(events.metadata().id), {*rows["stream_type"].to_pylist(),
                                                                *last["stream_type"].to_pylist()})
    if held:
        rows, last = rebuild.without(rows, held), rebuild.without(last, held)
    rows, last = rows.drop_columns(["stream_type"]), last.drop_columns(["stream_type"])
    joined = rows.join(last, keys, join_type="full outer")
    bad = joined.filter(pc.and_(pc.is_null(joined["parked"]), pc.or_kleene(
        pc.or_kleene(pc.is_null(joined["version"]), pc.is_null(joined["max_version"])),
        pc.not_equal(joined["version"].cast(pa.int64()), joined["max_version"].cast(pa.int64())))))
    return VersionsOff(bad.num_rows, bad["stream_id"].slice(0, 5).to_pylist(), events_version,
                       quarantined=quarantined)
