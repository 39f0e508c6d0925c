"""`Aggregate`: a table of additive aggregates of `events` (counts add up, first/last times take the min/max),
kept incrementally by Spark, or for a small increment by pyarrow and delta-rs (no Dagster here). A kind of the
projection kernel: lake/kernel/runner.py runs its updates.

The built-in ones, `stream_catalog` and `event_type_daily`, are in lake/aggregates/builtin.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from es_pipeline.lake.delta import current, pieces, tables
from es_pipeline.lake.delta.definition import Reconciled, Table, rows_off
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel import position
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.kernel.position import Position
from es_pipeline.lake.kernel.projection import Increment, Kind
from es_pipeline.lake.kernel.result import Ran, Result
from es_pipeline.lake.kernel.turn import Turn

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Aggregate(Kind):
    """An additive aggregate of `events`, kept incrementally: `table`, and how its rows are computed and merged.

    Each run aggregates only the rows that the `events` commits since the last run added (Delta's
    change data feed) and merges them in: counts add up, first/last times take the min/max. The
    `events` version folded in is the MERGE's own Delta transaction id (`txnAppId`/`txnVersion`),
    committed atomically with the rows, so a retry or a crash never counts an event twice; the app id names
    the `events` table (lake/delta/definition.py `over`). The first run, or one on a table with no such id (built from
    another `events`, or by an older es_pipeline), builds from the whole table instead, overwriting it.
    """

    table: Table
    aggregate: Callable[[Any], Any]  # events frame -> one row per key, in the table's columns
    aggregate_arrow: Callable[[pa.Table], pa.Table]  # the same over Arrow rows (the small increment's)
    columns: tuple[str, ...]  # the events columns both aggregates read
    updates: dict[str, str]  # per column, how the row (t) takes an increment (u): Spark SQL and DataFusion alike
    combine: dict[str, str]  # per column not in the key, how two rows of a key combine in pyarrow ("min", "sum"...)

    @property
    def name(self) -> str:
        return self.table.name

    @property
    def key(self) -> tuple[str, ...]:
        return self.table.key

    @property
    def merge_set(self) -> str:
        """The UPDATE SET clause of Spark's MERGE."""
        return ", ".join(f"t.{column} = {expression}" for column, expression in self.updates.items())

    def ready(self, path: str, target: DeltaTable, events_id: str) -> DeltaTable | None:
        """An increment merges onto a table whose key is this release's (one of a release before tenants lacks
        `tenant`: built whole)."""
        return target if tables.has_columns(target, self.key) else None

    def up_to_date(self, target: DeltaTable, position: Position, now: int) -> Result:
        assert position.events_version is not None
        return self._result(now, position.events_version, 0, 0, current.row_count(target))

    def fold(self, rows: pa.Table, increment: Increment) -> _Merge:
        """The increment aggregated by pyarrow, to merge by delta-rs (lake/kernel/runner.py `increment`)."""
        return _Merge(self, self.aggregate_arrow(rows), rows.num_rows, increment)

    def build_here(self, warehouse: Location, turn: Turn, engine: Engine) -> Result | None:
        """A whole build (the first, or one over another `events`) aggregated by pyarrow and written by delta-rs,
        `events` read in bounded pieces (by slice span where a row is a stream's, else a million events at a
        time) (the runner asks only within the engine rule's bound); None: Spark's to do, or
        not a whole build (an increment the runner left to Spark)."""
        events_path, path = EVENTS.path(warehouse), self.table.path(warehouse)
        events = DeltaTable(events_path)
        at = Position.of(path, self.table.app_id_over(tables.table_id(events_path)))
        prev = at.read
        if prev is not None and tables.has_columns(path, self.key):
            return None  # built from this `events`: an increment
        size = tables.files_bytes(events)  # the pieces `events` is read in
        now = int(events.version())
        read = [0]
        # The table's rows held (a row per key: `events` itself is read in pieces), so that the turn is confirmed
        # right before the write, as every build does, and no read of `events` runs inside delta-rs's write.
        rows = list(self._aggregated(events_path, events, size, read))
        position.fence_older(path, [(self.table.app_id, position.FENCE)])
        turn.confirm(path, at.app_id, prev)
        self.table.ensure_arrow(warehouse)
        written = sum(t.num_rows for t in rows)
        write_deltalake(path, pa.Table.from_batches([b for t in rows for b in t.to_batches()], schema=self.table.schema),
                        mode="overwrite", schema_mode="overwrite", commit_properties=at.commit(now))
        return self._result(now, -1, read[0], written, written)

    def _aggregated(self, events_path: str, events: DeltaTable, size: int, read: list[int]) -> Iterator[pa.Table]:
        """The table's rows from `events` (its `size` bytes of files) in bounded pieces, a part at a time (`read[0]`
        counts the events read)."""

        def rows_of(source: Iterable[pa.Table]) -> Iterator[pa.Table]:
            for rows in source:
                read[0] += rows.num_rows
                for c in self.columns:
                    if c not in rows.column_names:  # a lake of a release before tenants: every row of no tenant
                        rows = rows.append_column(c, pa.nulls(rows.num_rows, pa.string()))
                yield self.aggregate_arrow(rows).cast(self.table.schema)

        if "stream_id" in self.key:
            # One row per stream: `events` spread by slice span (a stream lives in one slice), each piece's rows
            # final as they come: memory for one piece, whatever the lake's size or its streams.
            columns = [*self.columns, "slice"]
            count = pieces.count_for(size)
            with pieces.spread(pieces.batches(events_path, events, columns), pieces.schema(events, columns), count,
                               pieces.by_slice(count)) as parts:
                yield from rows_of(parts.read(i) for i in range(parts.count))
            return
        # Few rows (per day and type): a million events at a time, each step combined with those before.
        agg = None
        for step in rows_of(pieces.chunks(pieces.batches(events_path, events, self.columns))):
            agg = step if agg is None else self._combined(pa.concat_tables([agg, step]))
        if agg is not None:
            yield agg

    def _combined(self, rows: pa.Table) -> pa.Table:
        """`rows` with one row per key, by `combine`."""
        g = rows.group_by(list(self.key)).aggregate(list(self.combine.items()))
        return pa.table({c: g[f"{c}_{self.combine[c]}"] if c in self.combine else g[c]
                         for c in self.table.schema.names}).cast(self.table.schema)

    def reconcile(self, engine: Engine, warehouse: Location) -> Reconciled:
        """The table (one snapshot of it) against its aggregate of `events` at the version that snapshot folded:
        every row equal. In process (`events` in bounded pieces, as a build reads it) where the engine rule says
        (`engine`), else, or where the table has deletion vectors, Spark."""
        path, events_path = self.table.path(warehouse), EVENTS.path(warehouse)
        if not tables.is_delta_table(path) or not tables.is_delta_table(events_path):
            return Reconciled(None, note=f"{self.name} not built yet")
        target = DeltaTable(path)
        folded = Position.of(target, self.table.app_id_over(tables.table_id(events_path))).events_version
        if folded is None:
            return Reconciled(None, note=f"{self.name} not built from this `events` yet: its next update builds it")
        events = DeltaTable(events_path, version=int(folded))
        key = list(self.key)
        size = tables.files_bytes(events)
        if current.has_deletion_vectors(target) or engine.on_spark(lambda: size):
            session = engine.session()
            expected = self.aggregate(tables.with_tenant(tables.read(session, events_path, version=int(folded))))
            actual = tables.read(session, path, version=int(target.version())).select(*expected.columns)
            bad = expected.exceptAll(actual).select(*key).union(actual.exceptAll(expected).select(*key)).distinct()
            examples = tuple(" ".join(str(v) for v in r) for r in bad.limit(5).collect())
            return Reconciled(int(folded), int(bad.count()), examples, engine="spark")
        parts = list(self._aggregated(events_path, events, size, [0]))
        expected = pa.concat_tables(parts) if parts else self.table.schema.empty_table()
        n, examples = rows_off(expected, current.plain(current.files(path, target).to_table()), key)
        return Reconciled(int(folded), n, examples, engine="local")

    def update_on_spark(self, spark: SparkSession, warehouse: Location, turn: Turn) -> Result:
        events_path = EVENTS.path(warehouse)
        path = self.table.path(warehouse)
        now = tables.table_version(spark, events_path)
        at = Position.of(path, self.table.app_id_over(tables.table_id(events_path)))
        app_id, prev = at.app_id, at.read  # None: a first build, or the table is of another `events`
        if prev is not None and not tables.has_columns(path, self.key):
            prev = None  # a table of a release before tenants (its key lacks `tenant`): built whole, below
        if prev is not None and prev >= now:
            return self._result(now, prev, 0, 0, _count(spark, path), engine="spark")
        if prev is not None:
            agg = self.aggregate(tables.with_tenant(tables.rows_added(spark, events_path, prev, now))).cache()
            try:
                n, read = _figures(agg)
                turn.confirm(path, app_id, prev)
                tables.merge_by_key(spark, path, agg, self.key, app_id=app_id, version=now, update_set=self.merge_set)
                return self._result(now, prev, read, n, _count(spark, path), engine="spark")
            except tables.spark_errors() as exc:
                if not tables.change_feed_gone(exc):
                    raise
                # The files of those commits were vacuumed (the projection lagged past the retention):
                # the increment cannot be read, so the table is built whole, as on a first run.
                log.warning("%s: the change feed after version %s is gone (vacuumed); rebuilding", self.name, prev)
            finally:
                agg.unpersist()
        # First run, a table of another `events` or an older es_pipeline, or a change feed vacuumed away: built whole.
        if prev is None:
            position.fence_older(path, [(self.table.app_id, position.FENCE)])
        agg = self.aggregate(tables.with_tenant(tables.read(spark, events_path, version=now))).cache()
        try:
            n, read = _figures(agg)
            turn.confirm(path, app_id, prev)
            (agg.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
             .option("txnAppId", app_id).option("txnVersion", str(now)).save(path))
        finally:
            agg.unpersist()
        return self._result(now, -1, read, n, _count(spark, path), engine="spark")

    def _result(self, now: int, previous: int, read: int, keys: int, rows: int,
                engine: Ran = "local") -> Result:
        return Result(self.name, now, previous, read, engine, rows, {"keys_updated": keys})


@dataclass(frozen=True)
class _Merge:
    """An increment's rows, one per key, merged into the table: counts add up, first/last times take the min/max."""

    aggregate: Aggregate
    rows: pa.Table
    events_folded: int
    increment: Increment

    def commit(self, txn: int) -> Result:
        target, properties = self.increment.target, self.increment.position.commit(txn)
        if self.rows.num_rows:
            target.merge(self.rows, predicate=" AND ".join(f"t.{k} = u.{k}" for k in self.aggregate.key),
                         source_alias="u", target_alias="t", commit_properties=properties) \
                .when_matched_update(self.aggregate.updates).when_not_matched_insert_all().execute()
        else:  # nothing added (only compaction since): record the version all the same
            position.record(target, properties)
        target.update_incremental()
        return self.aggregate._result(self.increment.now, self.increment.previous, self.events_folded,
                                      self.rows.num_rows, current.row_count(target))


def _count(spark: SparkSession, path: str) -> int:
    return int(tables.read(spark, path).count())


def _figures(agg: Any) -> tuple[int, int]:
    """(keys, events) of an aggregate, in one job."""
    from pyspark.sql import functions as F

    row = agg.agg(F.count(F.lit(1)).alias("keys"), F.sum("events").alias("events")).first()
    return int(row["keys"] or 0), int(row["events"] or 0)
