"""The built-in aggregates of `events`, which need no domain: `stream_catalog` (one row per stream) and
`event_type_daily` (stream type x event type x day), additive (lake/aggregates/aggregate.py)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from es_pipeline.lake.aggregates.aggregate import Aggregate
from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.definition import Table
from es_pipeline.lake.delta.tables import UTC_MICROS, Location
from es_pipeline.lake.kernel import runner
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.kernel.result import Result


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


STREAM_CATALOG = Aggregate(
    Table("stream_catalog", pa.schema([
        ("stream_id", pa.string()), ("stream_type", pa.string()), ("first_event_at", UTC_MICROS), ("version", pa.int32()),
        ("events", pa.int64()), ("last_event_at", UTC_MICROS), ("tenant", pa.string())]),
        key=("tenant", "stream_id"), comment="one row per stream: type, first and last event, count, version"),
    aggregate=_catalog,
    aggregate_arrow=_catalog_arrow,
    columns=("tenant", "stream_id", "stream_type", "recorded_at", "version"),
    updates={
        "first_event_at": "least(t.first_event_at, u.first_event_at)", "version": "greatest(t.version, u.version)",
        "events": "t.events + u.events", "last_event_at": "greatest(t.last_event_at, u.last_event_at)",
    },
    combine={"stream_type": "min", "first_event_at": "min", "version": "max", "events": "sum",
             "last_event_at": "max"},
)

EVENT_TYPE_DAILY = Aggregate(
    Table("event_type_daily", pa.schema([
        ("stream_type", pa.string()), ("event_type", pa.string()), ("event_date", pa.date32()),
        ("events", pa.int64()), ("tenant", pa.string())]),
        key=("tenant", "stream_type", "event_type", "event_date"), comment="events per stream type, event type and day"),
    aggregate=_daily,
    aggregate_arrow=_daily_arrow,
    columns=("tenant", "stream_type", "event_type", "event_date"),
    updates={"events": "t.events + u.events"},
    combine={"events": "sum"},
)


def update_stream_catalog(engine: Engine, warehouse: Location, *, store_dsn: str | None = None) -> Result:
    """One row per stream: type, first and last event time, event count, version (incremental)."""
    return runner.update(STREAM_CATALOG, engine, warehouse, store_dsn=store_dsn)


def update_event_type_daily(engine: Engine, warehouse: Location, *, store_dsn: str | None = None) -> Result:
    """Stream type x event type x day: count (incremental)."""
    return runner.update(EVENT_TYPE_DAILY, engine, warehouse, store_dsn=store_dsn)
