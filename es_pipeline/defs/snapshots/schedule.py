"""`snapshots_schedule`: every 10 minutes, snapshot the streams that outgrew their last snapshot."""

import dagster as dg

from es_pipeline.defs.checks import BUILTIN as CHECKS
from es_pipeline.defs.snapshots.asset import snapshots

# The stream_state check is blocking and in the same run: when `stream_state` does not match `events`, the
# snapshots step does not run, and no such state is written back to the store (es_pipeline/checks/projections.py).
snapshots_job = dg.define_asset_job(
    "snapshots_job",
    selection=dg.AssetSelection.assets(snapshots) | dg.AssetSelection.checks(CHECKS["stream_state_version_matches_events"]),
    description="Check that stream_state matches events, then take snapshots of streams that outgrew their last one.",
)

snapshots_schedule = dg.ScheduleDefinition(
    name="snapshots_schedule",
    job=snapshots_job,
    cron_schedule="*/10 * * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Every 10 minutes: snapshot the streams that grew past the threshold, write them back to Postgres.",
)
