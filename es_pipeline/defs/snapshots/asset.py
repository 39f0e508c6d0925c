"""The `snapshots` asset: per-stream snapshots in Delta, written back to the event store."""

import dagster as dg

from es_pipeline.defs.resources import EventStoreResource, SparkResource, WarehouseResource, engine_of
from es_pipeline.defs.stopping import projection_run
from es_pipeline.lake.state.snapshots import DEFAULT_THRESHOLD, take_snapshots


class SnapshotConfig(dg.Config):
    threshold: int = DEFAULT_THRESHOLD
    """Take a snapshot of a stream once it has this many events more than its last snapshot."""


@dg.asset(
    deps=["stream_state"],
    kinds={"spark", "delta", "postgres"},
    owners=["team:data-engineering"],
    tags={"layer": "snapshot"},
    description="One row per (stream, version) snapshot taken, for streams that grew past a threshold since "
    "their last snapshot or whose reducer revision changed; each is also written back to the event "
    "store's snapshot table, so that `load` = snapshot + the events after it.",
)
def snapshots(
    context: dg.AssetExecutionContext, config: SnapshotConfig, spark: SparkResource, warehouse: WarehouseResource, event_store: EventStoreResource
) -> dg.MaterializeResult:
    # The write-back goes through the snapshot writer's own login when ES_PIPELINE_SNAPSHOT_DSN names one.
    # Spark only where needed: up to SMALL_SNAPSHOTS streams pyarrow and delta-rs take them (lake/state/snapshots.py),
    # or as ES_PIPELINE_ENGINE says.
    with projection_run(context):
        r = take_snapshots(engine_of(warehouse, spark), warehouse.root, event_store.snapshot_store(),
                           threshold=config.threshold)
    return dg.MaterializeResult(metadata=r.metadata())
