"""The built-in projections of `events` that need no domain: `stream_catalog` and `event_type_daily` (additive
aggregates, lake/aggregate.py), and `follow`, every projection's small increment for a tailing run."""

from __future__ import annotations

from typing import Any

import psycopg
import pyarrow as pa

from es_pipeline.domain import Domain
from es_pipeline.lake import cross_stream, event_tables, tables
from es_pipeline.lake.aggregate import Aggregate, ProjectionResult
from es_pipeline.lake.cross_stream import CrossStreamResult, Frontier
from es_pipeline.lake.event_tables import EventTablesResult
from es_pipeline.lake.feed import Feed
from es_pipeline.lake.fold import StateResult, read_columns
from es_pipeline.lake.serial import turn_if_free
from es_pipeline.lake.stream_state import small_increment, with_typed_state
from es_pipeline.lake.table import Table
from es_pipeline.lake.tables import Location

_AT = pa.timestamp("us", tz="UTC")


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
        ("stream_id", pa.string()), ("stream_type", pa.string()), ("first_event_at", _AT), ("version", pa.int32()),
        ("events", pa.int64()), ("last_event_at", _AT), ("tenant", pa.string())]),
        key=("tenant", "stream_id"), comment="one row per stream: type, first and last event, count, version"),
    aggregate=_catalog,
    aggregate_arrow=_catalog_arrow,
    columns=("tenant", "stream_id", "stream_type", "recorded_at", "version"),
    updates={
        "first_event_at": "least(t.first_event_at, u.first_event_at)", "version": "greatest(t.version, u.version)",
        "events": "t.events + u.events", "last_event_at": "greatest(t.last_event_at, u.last_event_at)",
    },
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


def follow(
    warehouse: tables.Location, store: str | psycopg.Connection, domain: Domain, frontier: Frontier | None = None,
) -> dict[str, ProjectionResult | StateResult | CrossStreamResult | EventTablesResult]:
    """Every projection's small increment now, each in its turn (a tailing `events` run keeps them fresh
    this way), from one read of `events`' change feed: the built-in ones, then `domain`'s cross-stream ones
    (up to `frontier`, lake/cross_stream.py), then the typed event tables (from their own read of the feed). A projection whose turn another update holds, or that needs
    Spark or a whole build, is left out: its automation's run does it. `store`: the store's DSN, or a
    `lock_transaction` connection kept for the turns."""
    events_path = tables.table_path(warehouse, "events")
    if not tables.is_delta_table(events_path):
        return {}
    if frontier is not None and domain.projections:  # read before the lake (lake/cross_stream.py)
        read_first = frontier()
        frontier = lambda: read_first  # noqa: E731 - the one value read, for every projection of this follow
    events_feed = Feed(events_path, [*read_columns(domain), *STREAM_CATALOG.columns, *EVENT_TYPE_DAILY.columns,
                                     *(cross_stream.columns_of(domain) if domain.projections else ())])
    done: dict[str, ProjectionResult | StateResult | CrossStreamResult | EventTablesResult] = {}
    with turn_if_free(store, "stream_state") as turn:
        state = small_increment(warehouse, domain, False, turn, events_feed) if turn is not None else None
        if state is not None:
            done["stream_state"] = with_typed_state(warehouse, domain, state)
    for projection in (STREAM_CATALOG, EVENT_TYPE_DAILY):
        with turn_if_free(store, projection.name) as turn:
            result = projection.small_increment(warehouse, turn, events_feed) if turn is not None else None
            if result is not None:
                done[projection.name] = result
    for name, cross in sorted(domain.projections.items()):
        with turn_if_free(store, name) as turn:
            crossed = None if turn is None else cross_stream.increment(
                warehouse, cross, domain, turn, frontier, events_feed, build=False)
            if crossed is not None:
                done[name] = crossed
    with turn_if_free(store, event_tables.NAME) as turn:
        typed = None if turn is None else event_tables.increment(warehouse, domain, build=False)
        if typed is not None:
            done[event_tables.NAME] = typed
    return done
