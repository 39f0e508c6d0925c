"""The code location, `es_pipeline.definitions:defs`: every Dagster object, assembled from `defs/`.

Explicit rather than autoloaded: the partitions, the sensor's interval, the automation switch and
the `events` asset's writer come from `Settings`, so `build_definitions(settings)` builds all of it.
"""

import dagster as dg

from es_pipeline.defs.events.asset import build_events_asset, build_events_job
from es_pipeline.defs.events.partitions import slice_ranges_partitions
from es_pipeline.defs.events.sensor import build_new_events_sensor
from es_pipeline.defs.maintenance.jobs import CHECKS, delta_maintenance_job, lake_checks_job
from es_pipeline.defs.maintenance.schedules import delta_maintenance_schedule, lake_checks_schedule
from es_pipeline.defs.projections.assets import ASSETS as PROJECTIONS
from es_pipeline.defs.projections.automation import build_projections_automation_sensor
from es_pipeline.defs.resources import build_resources
from es_pipeline.defs.snapshots.asset import snapshots
from es_pipeline.defs.snapshots.schedule import snapshots_job, snapshots_schedule
from es_pipeline.extraction.slices import split
from es_pipeline.settings import Settings


def build_definitions(settings: Settings | None = None) -> dg.Definitions:
    settings = settings or Settings.from_env()
    events = build_events_asset(slice_ranges_partitions(settings.slice_ranges), settings)
    events_job = build_events_job(events)
    new_events_sensor = build_new_events_sensor(
        events_job, split(settings.slice_ranges), interval_seconds=settings.sensor_interval_seconds,
        tail_seconds=settings.tail_seconds,
    )
    return dg.Definitions(
        assets=[events, *PROJECTIONS, snapshots],
        asset_checks=CHECKS,
        jobs=[events_job, lake_checks_job, delta_maintenance_job, snapshots_job],
        sensors=[new_events_sensor, build_projections_automation_sensor(running=settings.automation)],
        schedules=[delta_maintenance_schedule, snapshots_schedule, lake_checks_schedule],
        resources=build_resources(settings),
        # Every job's steps in the run's own process unless it says otherwise: a hand materialization of a
        # range with its checks, or the projections' automation run, starts one Spark session, not one per step.
        executor=dg.in_process_executor,
    )


defs = build_definitions()
