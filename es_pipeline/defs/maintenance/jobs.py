"""Maintenance jobs: Delta compaction and vacuum of every table; the table-wide checks of the lake."""

import dagster as dg

from es_pipeline.defs.resources import EventStoreResource, WarehouseResource
from es_pipeline.lake.maintenance import maintain


@dg.op(description="Compaction then vacuum (168 hours kept) of every Delta table of the warehouse, each in its "
       "update's turn, by delta-rs (no Spark).")
def delta_maintenance(
    context: dg.OpExecutionContext, warehouse: WarehouseResource, event_store: EventStoreResource
) -> None:
    for table, metrics in maintain(warehouse.root, store_dsn=event_store.dsn).items():
        context.log.info(f"{table}: compacted {metrics['files_removed']} files into {metrics['files_added']}")


@dg.job(description="Compaction and vacuum of the Delta tables.", tags={"es_pipeline/maintenance": "delta"})
def delta_maintenance_job() -> None:
    delta_maintenance()


# In-process: the checks read the whole lake with Spark; a step subprocess would only add a start-up.
# Every check of the location (defs/checks.py `build_asset_checks`): the built-in tables', and one per cross-stream
# projection of the team's domain.
lake_checks_job = dg.define_asset_job(
    "lake_checks_job", selection=dg.AssetSelection.all_asset_checks(), executor_def=dg.in_process_executor,
    description="Table-wide invariants of `events` against the store, and of every projection against `events`.",
)
