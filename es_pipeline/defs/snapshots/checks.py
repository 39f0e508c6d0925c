"""Table-wide check of `snapshots`: the store holds the latest snapshot of every stream in the lake."""

import dagster as dg

from es_pipeline.defs.resources import EventStoreResource, SparkResource, WarehouseResource
from es_pipeline.lake.state.snapshots import not_in_store, not_in_store_small


@dg.asset_check(
    asset="snapshots", blocking=True,
    description="For every stream, the event store's snapshot table (`es.snapshots`, or `es_pipeline.snapshots` for an "
    "adopted store) holds the latest snapshot in the lake "
    "(same version and revision), so that `load` starts from it. The next `snapshots` run writes back any that differ.",
)
def snapshots_match_store(
    spark: SparkResource, warehouse: WarehouseResource, event_store: EventStoreResource
) -> dg.AssetCheckResult:
    if not event_store.store().has_snapshots_table():
        return dg.AssetCheckResult(passed=False, metadata={
            "streams_differing": 0, "note": "the store has no snapshot table: run `es-pipeline db migrate` (the native "
            "store) or `es-pipeline source adopt` (another store: it creates es_pipeline.snapshots)"})
    small = not_in_store_small(warehouse.root, event_store.store())  # no JVM, up to SMALL_SNAPSHOT_ROWS
    if small is not None:
        n, examples = small.num_rows, small.slice(0, 5).to_pylist()
    else:
        missing = not_in_store(spark.spark_session, warehouse.root, event_store.store())
        n, examples = int(missing.count()), [r.asDict() for r in missing.limit(5).collect()]
    return dg.AssetCheckResult(
        passed=n == 0,
        metadata={"streams_differing": n, "examples": ", ".join(f"{r['stream_id']}@{r['version']}" for r in examples)},
    )


CHECKS = [snapshots_match_store]
