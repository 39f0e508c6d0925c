"""Table-wide check of `snapshots`: the store holds the latest snapshot of every stream in the lake."""

import dagster as dg

from es_pipeline.defs.resources import EventStoreResource, SparkResource, WarehouseResource
from es_pipeline.lake.snapshots import not_in_store


@dg.asset_check(
    asset="snapshots", blocking=True,
    description="For every stream, the event store's snapshot table holds the latest snapshot in the lake "
    "(same version and revision), so that `load` starts from it. The next `snapshots` run writes back any that differ.",
)
def snapshots_match_store(
    spark: SparkResource, warehouse: WarehouseResource, event_store: EventStoreResource
) -> dg.AssetCheckResult:
    missing = not_in_store(spark.spark_session, warehouse.root, event_store.store())
    n = int(missing.count())
    return dg.AssetCheckResult(
        passed=n == 0,
        metadata={"streams_differing": n,
                  "examples": ", ".join(f"{r['stream_id']}@{r['version']}" for r in missing.limit(5).collect())},
    )


CHECKS = [snapshots_match_store]
