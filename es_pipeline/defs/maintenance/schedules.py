"""Hourly maintenance: the lake's checks at :07, Delta compaction and vacuum at :17."""

import dagster as dg

from es_pipeline.defs.maintenance.jobs import delta_maintenance_job, lake_checks_job

delta_maintenance_schedule = dg.ScheduleDefinition(
    name="delta_maintenance_schedule",
    job=delta_maintenance_job,
    cron_schedule="17 * * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Hourly: compact the small files that frequent incremental commits leave, vacuum old files.",
)

lake_checks_schedule = dg.ScheduleDefinition(
    name="lake_checks_schedule", job=lake_checks_job, cron_schedule="7 * * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Hourly: no duplicates, contiguous versions, counts reconcile with Postgres, state matches events, "
    "snapshots reached the store.",
)
