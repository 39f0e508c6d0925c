"""Read models over the Delta `events` table: Spark, or for a small increment Arrow and delta-rs (no Dagster here)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from es_pipeline.lake import small_increments as small
from es_pipeline.lake import tables
from es_pipeline.lake.serial import Turn, one_at_a_time
from es_pipeline.lake.tables import Location

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProjectionResult:
    rows: int  # rows of the table after the run
    events_version: int  # the `events` table version now folded in
    previous_events_version: int  # -1: the table was (re)built from the whole of `events`
    events_read: int  # events aggregated by this run (the increment, or all on a rebuild)
    keys_updated: int  # rows inserted or updated by this run


@dataclass(frozen=True)
class _Projection:
    """An additive aggregate of `events`, kept incrementally.

    Each run aggregates only the rows that the `events` commits since the last run added (Delta's
    change data feed) and merges them in: counts add up, first/last times take the min/max. The
    `events` version folded in is the MERGE's own Delta transaction id (`txnAppId`/`txnVersion`),
    committed atomically with the rows, so a retry or a crash never counts an event twice. The
    first run, or one on a table with no such id, builds from the whole table instead.
    """

    name: str
    key: tuple[str, ...]
    aggregate: Callable[[Any], Any]  # events frame -> one row per key
    aggregate_arrow: Callable[[pa.Table], pa.Table]  # the same over Arrow rows (lake/small_increments.py)
    columns: tuple[str, ...]  # the events columns both aggregates read
    updates: dict[str, str]  # per column, how the row (t) takes an increment (u): Spark SQL and DataFusion alike

    @property
    def app_id(self) -> str:
        return f"es_pipeline.{self.name}"

    @property
    def merge_set(self) -> str:
        """The UPDATE SET clause of Spark's MERGE."""
        return ", ".join(f"t.{column} = {expression}" for column, expression in self.updates.items())

    def update(
        self, spark: Any, warehouse: Location, *, store_dsn: str | None = None, small_increments: bool = True
    ) -> ProjectionResult:
        """Fold the `events` commits since the last update in; with `store_dsn`, one update at a time.

        `spark`: a session, or a function that returns one, called only if Spark is needed: a small
        increment is aggregated and merged without a JVM (lake/small_increments.py) unless told not to."""
        with one_at_a_time(store_dsn, self.name) as turn:
            if small_increments:
                done = small.update_projection(self, warehouse, turn)
                if done is not None:
                    return done
            return self._update(tables.session_of(spark), warehouse, turn)

    def _update(self, spark: Any, warehouse: Location, turn: Turn) -> ProjectionResult:
        events_path = tables.table_path(warehouse, "events")
        path = tables.table_path(warehouse, self.name)
        now = tables.table_version(spark, events_path)
        prev = tables.transaction_version(path, self.app_id)
        if prev is not None and not tables.has_columns(path, self.key):
            prev = None  # a table of a release before tenants (its key lacks `tenant`): built whole, below
        if prev is not None and prev >= now:
            return ProjectionResult(_count(spark, path), now, prev, 0, 0)
        if prev is not None:
            agg = self.aggregate(tables.with_tenant(tables.rows_added(spark, events_path, prev, now))).cache()
            try:
                n, read = _figures(agg)
                turn.confirm(path, self.app_id, prev)
                tables.merge_by_key(spark, path, agg, self.key, app_id=self.app_id, version=now, update_set=self.merge_set)
                return ProjectionResult(_count(spark, path), now, prev, read, n)
            except tables.spark_errors() as exc:
                if not tables.change_feed_gone(exc):
                    raise
                # The files of those commits were vacuumed (the projection lagged past the retention):
                # the increment cannot be read, so the table is built whole, as on a first run.
                log.warning("%s: the change feed after version %s is gone (vacuumed); rebuilding", self.name, prev)
            finally:
                agg.unpersist()
        # First run, a table of an older es_pipeline, or a change feed vacuumed away: build it whole.
        agg = self.aggregate(tables.with_tenant(tables.read(spark, events_path, version=now))).cache()
        try:
            n, read = _figures(agg)
            turn.confirm(path, self.app_id, prev)
            (agg.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
             .option("txnAppId", self.app_id).option("txnVersion", str(now)).save(path))
        finally:
            agg.unpersist()
        return ProjectionResult(_count(spark, path), now, -1, read, n)


def _count(spark: Any, path: str) -> int:
    return int(tables.read(spark, path).count())


def _figures(agg: Any) -> tuple[int, int]:
    """(keys, events) of an aggregate, in one job."""
    from pyspark.sql import functions as F

    row = agg.agg(F.count(F.lit(1)).alias("keys"), F.sum("events").alias("events")).first()
    return int(row["keys"] or 0), int(row["events"] or 0)


# Every projection is keyed by tenant first; `tenant` is their last column, where a table of an older
# release (rebuilt whole once, see `_update`) would have taken it.
def _catalog(events: Any) -> Any:
    from pyspark.sql import functions as F

    return events.groupBy("tenant", "stream_id").agg(
        F.first("stream_type").alias("stream_type"), F.min("recorded_at").alias("first_event_at"),
        F.max("version").alias("version"), F.count(F.lit(1)).alias("events"),
        F.max("recorded_at").alias("last_event_at"),
    ).select("stream_id", "stream_type", "first_event_at", "version", "events", "last_event_at", "tenant")


def _daily(events: Any) -> Any:
    from pyspark.sql import functions as F

    return events.groupBy("tenant", "stream_type", "event_type", "event_date").agg(
        F.count(F.lit(1)).alias("events")).select("stream_type", "event_type", "event_date", "events", "tenant")


def _catalog_arrow(events: pa.Table) -> pa.Table:
    g = tables.tenant_filled(events).group_by(["tenant", "stream_id"]).aggregate([
        ("stream_type", "min"), ("recorded_at", "min"), ("version", "max"), ("stream_id", "count"),
        ("recorded_at", "max")])
    return pa.table({
        "stream_id": g["stream_id"], "stream_type": g["stream_type_min"], "first_event_at": g["recorded_at_min"],
        "version": g["version_max"], "events": g["stream_id_count"].cast(pa.int64()),
        "last_event_at": g["recorded_at_max"], "tenant": g["tenant"],
    })


def _daily_arrow(events: pa.Table) -> pa.Table:
    g = tables.tenant_filled(events).group_by(["tenant", "stream_type", "event_type", "event_date"]).aggregate(
        [([], "count_all")])
    return pa.table({"stream_type": g["stream_type"], "event_type": g["event_type"], "event_date": g["event_date"],
                     "events": g["count_all"].cast(pa.int64()), "tenant": g["tenant"]})


STREAM_CATALOG = _Projection(
    name="stream_catalog",
    key=("tenant", "stream_id"),
    aggregate=_catalog,
    aggregate_arrow=_catalog_arrow,
    columns=("tenant", "stream_id", "stream_type", "recorded_at", "version"),
    updates={
        "first_event_at": "least(t.first_event_at, u.first_event_at)", "version": "greatest(t.version, u.version)",
        "events": "t.events + u.events", "last_event_at": "greatest(t.last_event_at, u.last_event_at)",
    },
)

EVENT_TYPE_DAILY = _Projection(
    name="event_type_daily",
    key=("tenant", "stream_type", "event_type", "event_date"),
    aggregate=_daily,
    aggregate_arrow=_daily_arrow,
    columns=("tenant", "stream_type", "event_type", "event_date"),
    updates={"events": "t.events + u.events"},
)


def update_stream_catalog(
    spark: Any, warehouse: Location, *, store_dsn: str | None = None, small_increments: bool = True
) -> ProjectionResult:
    """One row per stream: type, first and last event time, event count, version (incremental)."""
    return STREAM_CATALOG.update(spark, warehouse, store_dsn=store_dsn, small_increments=small_increments)


def update_event_type_daily(
    spark: Any, warehouse: Location, *, store_dsn: str | None = None, small_increments: bool = True
) -> ProjectionResult:
    """Stream type x event type x day: count (incremental)."""
    return EVENT_TYPE_DAILY.update(spark, warehouse, store_dsn=store_dsn, small_increments=small_increments)
