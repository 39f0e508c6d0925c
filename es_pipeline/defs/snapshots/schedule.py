"""`snapshots_schedule`: every 10 minutes, snapshot the streams that outgrew their last snapshot."""

import dagster as dg

from es_pipeline.defs.snapshots.asset import snapshots

snapshots_job = dg.define_asset_job(
    "snapshots_job", selection=dg.AssetSelection.assets(snapshots),
    description="Take snapshots of streams that outgrew their last one.",
)

snapshots_schedule = dg.ScheduleDefinition(
    name="snapshots_schedule",
    job=snapshots_job,
    cron_schedule="*/10 * * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Every 10 minutes: snapshot the streams that grew past the threshold, write them back to Postgres.",
)
