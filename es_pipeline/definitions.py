"""The code location: `es_pipeline.definitions:defs` (DESIGN §4)."""

import os

import dagster as dg

from es_pipeline.assets.events import build_events_asset
from es_pipeline.assets.projections import event_type_daily, snapshots, stream_catalog, stream_state
from es_pipeline.checks import CHECKS
from es_pipeline.partitions import slice_ranges_partitions
from es_pipeline.resources import build_resources
from es_pipeline.schedules import (
    delta_maintenance_job,
    delta_maintenance_schedule,
    snapshots_job,
    snapshots_schedule,
)
from es_pipeline.sensors import build_new_events_sensor
from es_pipeline.settings import Settings
from es_pipeline.slices import split


def build_definitions(settings: Settings | None = None) -> dg.Definitions:
    settings = settings or Settings.from_env()
    partitions = slice_ranges_partitions(settings.slice_ranges)
    events = build_events_asset(partitions)
    # In-process: no step subprocess to start (seconds of latency per run); the table-wide checks
    # run on their own schedule, not in every incremental run.
    events_job = dg.define_asset_job(
        "events_job", selection=dg.AssetSelection.assets(events).without_checks(),
        executor_def=dg.in_process_executor,
        description="Extract one slice range into the Delta `events` table.",
    )
    checks_job = dg.define_asset_job(
        "lake_checks_job", selection=dg.AssetSelection.checks(*CHECKS), executor_def=dg.in_process_executor,
        description="Table-wide invariants of `events` and `stream_state`.",
    )
    checks_schedule = dg.ScheduleDefinition(
        name="lake_checks_schedule", job=checks_job, cron_schedule="7 * * * *",
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="Hourly: no duplicates, contiguous versions, counts reconcile with Postgres, state matches events.",
    )
    automation = dg.AutomationConditionSensorDefinition(
        "projections_automation_sensor",
        target=dg.AssetSelection.assets(stream_catalog, event_type_daily, stream_state),
        # On unless ES_PIPELINE_AUTOMATION=off (the end-to-end extraction test turns it off).
        default_status=dg.DefaultSensorStatus.STOPPED
        if os.environ.get("ES_PIPELINE_AUTOMATION", "on") == "off"
        else dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=30,
        description="Declarative automation of the projections: they update after `events` does.",
    )
    return dg.Definitions(
        assets=[events, stream_catalog, event_type_daily, stream_state, snapshots],
        asset_checks=CHECKS,
        jobs=[events_job, checks_job, delta_maintenance_job, snapshots_job],
        sensors=[build_new_events_sensor(events_job, split(settings.slice_ranges)), automation],
        schedules=[delta_maintenance_schedule, snapshots_schedule, checks_schedule],
        resources=build_resources(settings),
    )


defs = build_definitions()
