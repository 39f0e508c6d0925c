"""Table-wide check of `stream_state`: every stream is folded up to its last event in `events`, as of the
`events` version the state has folded (its commits record it): events committed since wait for the next
update, and are not a failure.

Blocking, and part of `snapshots_job` (defs/snapshots/schedule.py): a failure stops the snapshots' write-back,
which would otherwise write a state that does not match the events into the store. Read with Arrow (no JVM)
up to `SMALL_CHECK_EVENTS` events, which the snapshots' schedule can afford every ten minutes."""

import dagster as dg

from es_pipeline.defs.resources import SparkResource, WarehouseResource
from es_pipeline.lake import tables
from es_pipeline.lake.stream_state import KEY, folded_version, versions_off_small


@dg.asset_check(
    asset="stream_state", blocking=True,
    description="Each stream's folded version equals its max version in `events` (unless events wait, parked, for a gap).",
)
def stream_state_version_matches_events(spark: SparkResource, warehouse: WarehouseResource) -> dg.AssetCheckResult:
    small = versions_off_small(warehouse.root)
    if small is not None:
        if small.events_version is None:
            return dg.AssetCheckResult(passed=True, metadata={"streams_off": 0, "note": "stream_state not built yet"})
        return dg.AssetCheckResult(passed=small.streams == 0, metadata={
            "streams_off": small.streams, "examples": ", ".join(small.examples),
            "events_version_folded": small.events_version, "read_with": "arrow"})
    s = spark.spark_session
    state_path = tables.table_path(warehouse.root, "stream_state")
    folded = folded_version(warehouse.root)
    if folded is None:
        return dg.AssetCheckResult(passed=True, metadata={"streams_off": 0, "note": "stream_state not built yet"})
    state_version, events_version = folded
    events = tables.with_tenant(tables.read(s, tables.table_path(warehouse.root, "events"), version=events_version)) \
        .groupBy(*KEY).agg({"version": "max"}).withColumnRenamed("max(version)", "max_version")
    state = tables.read(s, state_path, version=state_version)
    bad = state.join(events, list(KEY), "full_outer").where(
        "parked IS NULL AND (version IS NULL OR max_version IS NULL OR version <> max_version)")
    n = int(bad.count())
    return dg.AssetCheckResult(
        passed=n == 0,
        metadata={"streams_off": n, "examples": ", ".join(r["stream_id"] for r in bad.limit(5).collect()),
                  "events_version_folded": events_version},
    )


CHECKS = [stream_state_version_matches_events]
