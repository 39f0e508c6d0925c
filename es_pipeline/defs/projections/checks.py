"""Table-wide checks of the projections against `events`, each as of the `events` version the projection folded
(its commits record it): events committed since wait for the next update and are not a failure, so a check
compares like with like and cannot flap.

- `stream_state`: every stream folded up to its last event. Blocking, and part of `snapshots_job`
  (defs/snapshots/schedule.py): a failure stops the snapshots' write-back, which would otherwise write a state
  that does not match the events into the store. Read with Arrow (no JVM), `events` in bounded pieces, within
  the engine rule's bound (`on_spark`), which the snapshots' schedule can afford every ten minutes.
- `stream_catalog`, `event_type_daily`: every row equal to the aggregate of `events` (lake/aggregates/aggregate.py).
- each cross-stream projection: each key's event count equal to its events in `events`, less those waiting
  (lake/cross_stream.py `reconcile`).

On `lake_checks_job`'s schedule; a failure fires EsPipelineProjectionCheckFailed (health/alerts.yml)."""

from typing import Any

import dagster as dg
from deltalake import DeltaTable

from es_pipeline.defs.resources import SparkResource, WarehouseResource, engine_of
from es_pipeline.domain import Domain
from es_pipeline.lake import cross_stream
from es_pipeline.lake.aggregates.aggregate import Aggregate
from es_pipeline.lake.aggregates.builtin import EVENT_TYPE_DAILY, STREAM_CATALOG
from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.definition import Reconciled
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.state import rebuild
from es_pipeline.lake.state.stream_state import KEY, folded_version, versions_off_small


@dg.asset_check(
    asset="stream_state", blocking=True,
    description="Each stream's folded version equals its max version in `events` (unless events wait, parked, for a gap).",
)
def stream_state_version_matches_events(spark: SparkResource, warehouse: WarehouseResource) -> dg.AssetCheckResult:
    small = versions_off_small(warehouse.root, engine_of(warehouse, spark))
    if small is not None:
        if small.events_version is None:
            return dg.AssetCheckResult(passed=True, metadata={"streams_off": 0, "note": "stream_state not built yet"})
        return dg.AssetCheckResult(passed=small.streams == 0, metadata={
            "streams_off": small.streams, "examples": ", ".join(small.examples),
            "events_version_folded": small.events_version, "read_with": "arrow", "engine": "local"})
    from pyspark.sql import functions as F

    s = spark.spark_session
    state_path = tables.table_path(warehouse.root, "stream_state")
    folded = folded_version(warehouse.root)
    if folded is None:
        return dg.AssetCheckResult(passed=True, metadata={"streams_off": 0, "note": "stream_state not built yet"})
    state_version, events_version = folded
    events = tables.with_tenant(tables.read(s, EVENTS.path(warehouse.root), version=events_version)) \
        .groupBy(*KEY, "stream_type").agg({"version": "max"}).withColumnRenamed("max(version)", "max_version")
    state = tables.read(s, state_path, version=state_version)
    # A stream type held back for its rebuild beside stream_state (lake/state/rebuild.py) is behind until its swap.
    types = {r[0] for r in state.select("stream_type").union(events.select("stream_type")).distinct().collect()}
    held = rebuild.held_back(DeltaTable(state_path, version=state_version),
                             tables.table_id(EVENTS.path(warehouse.root)), types)
    if held:
        state, events = state.where(~F.col("stream_type").isin(held)), events.where(~F.col("stream_type").isin(held))
    events = events.drop("stream_type")
    bad = state.join(events, list(KEY), "full_outer").where(
        "parked IS NULL AND (version IS NULL OR max_version IS NULL OR version <> max_version)")
    n = int(bad.count())
    return dg.AssetCheckResult(
        passed=n == 0,
        metadata={"streams_off": n, "examples": ", ".join(r["stream_id"] for r in bad.limit(5).collect()),
                  "events_version_folded": events_version, "engine": "spark"},
    )


def _result(r: Reconciled) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=r.keys_off == 0, metadata=r.metadata())


def _aggregate_check(aggregate: Aggregate) -> Any:
    @dg.asset_check(
        asset=aggregate.name, name=f"{aggregate.name}_matches_events",
        description=f"Every row of {aggregate.name} equals the aggregate of `events` at the version it folded.",
    )
    def check(spark: SparkResource, warehouse: WarehouseResource) -> dg.AssetCheckResult:
        return _result(aggregate.reconcile(engine_of(warehouse, spark), warehouse.root))

    return check


def build_cross_stream_check(domain: Domain, name: str) -> dg.AssetChecksDefinition:
    """The check of the team's cross-stream projection `name`: each key's events folded, against `events`."""

    @dg.asset_check(
        asset=name, name=f"{name}_matches_events",
        description=f"Each key of {name} folded as many events as `events` holds of its types for it, at the version "
        "it folded (less those waiting for a lower batch).",
    )
    def check(warehouse: WarehouseResource) -> dg.AssetCheckResult:
        return _result(cross_stream.reconcile(warehouse.root, domain, name))

    return check


stream_catalog_matches_events = _aggregate_check(STREAM_CATALOG)
event_type_daily_matches_events = _aggregate_check(EVENT_TYPE_DAILY)

CHECKS = [stream_state_version_matches_events, stream_catalog_matches_events, event_type_daily_matches_events]


def build_projection_checks(domain: Domain) -> list[dg.AssetChecksDefinition]:
    """The checks of the domain's own projections (one per cross-stream projection)."""
    return [build_cross_stream_check(domain, name) for name in sorted(domain.projections)]
