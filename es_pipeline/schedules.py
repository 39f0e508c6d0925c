"""Schedules: Delta maintenance of every table, and snapshots (DESIGN §3, §4)."""

import dagster as dg

from es_pipeline.projections import maintain
from es_pipeline.resources import SparkResource, WarehouseResource


@dg.op(description="OPTIMIZE (compaction) then VACUUM RETAIN 168 HOURS on every Delta table of the warehouse.")
def delta_maintenance(context: dg.OpExecutionContext, spark: SparkResource, warehouse: WarehouseResource) -> None:
    for table, metrics in maintain(spark.spark_session, warehouse.root).items():
        context.log.info(f"{table}: compacted {metrics['files_removed']} files into {metrics['files_added']}")


@dg.job(description="Compaction and vacuum of the Delta tables.", tags={"es_pipeline/maintenance": "delta"})
def delta_maintenance_job() -> None:
    delta_maintenance()


delta_maintenance_schedule = dg.ScheduleDefinition(
    name="delta_maintenance_schedule",
    job=delta_maintenance_job,
    cron_schedule="17 * * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Hourly: compact the small files that frequent incremental commits leave, vacuum old files.",
)


snapshots_job = dg.define_asset_job(
    "snapshots_job", selection=["snapshots"], description="Take snapshots of streams that outgrew their last one."
)

snapshots_schedule = dg.ScheduleDefinition(
    name="snapshots_schedule",
    job=snapshots_job,
    cron_schedule="*/10 * * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Every 10 minutes: snapshot the streams that grew past the threshold, write them back to Postgres.",
)
