"""The code location: `es_pipeline.definitions:defs` (DESIGN §4)."""

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
    events_job = dg.define_asset_job(
        "events_job", selection=[events],
        description="Extract one slice range into the Delta `events` table.",
    )
    automation = dg.AutomationConditionSensorDefinition(
        "projections_automation_sensor",
        target=dg.AssetSelection.assets(stream_catalog, event_type_daily, stream_state),
        default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=30,
        description="Declarative automation of the projections: they update after `events` does.",
    )
    return dg.Definitions(
        assets=[events, stream_catalog, event_type_daily, stream_state, snapshots],
        asset_checks=CHECKS,
        jobs=[events_job, delta_maintenance_job, snapshots_job],
        sensors=[build_new_events_sensor(events_job, split(settings.slice_ranges)), automation],
        schedules=[delta_maintenance_schedule, snapshots_schedule],
        resources=build_resources(settings),
    )


defs = build_definitions()
