"""Every Dagster object of an es_pipeline code location, assembled from `defs/`: `build_definitions`.

Explicit rather than autoloaded: the partitions, the sensor's interval, the automation switch and the
`events` asset's writer come from `Settings`, and the reducers from a `Domain`, so
`build_definitions(settings, domain)` builds all of it. es_pipeline's own code location
(`es_pipeline.definitions`) and a team's (examples/shop/shop/definitions.py) both call it.
"""

import dagster as dg

from es_pipeline.defs.events.asset import build_events_asset, build_events_job
from es_pipeline.defs.events.partitions import slice_ranges_partitions
from es_pipeline.defs.events.sensor import build_new_events_sensor
from es_pipeline.defs.maintenance.jobs import CHECKS, delta_maintenance_job, lake_checks_job
from es_pipeline.defs.maintenance.schedules import delta_maintenance_schedule, lake_checks_schedule
from es_pipeline.defs.projections.assets import build_projection_assets
from es_pipeline.defs.projections.automation import build_projections_automation_sensor
from es_pipeline.defs.resources import build_resources
from es_pipeline.defs.snapshots.asset import snapshots
from es_pipeline.defs.snapshots.schedule import snapshots_job, snapshots_schedule
from es_pipeline.domain import Domain
from es_pipeline.domain import load as load_domain
from es_pipeline.extraction.slices import split
from es_pipeline.settings import Settings


def build_definitions(settings: Settings | None = None, domain: Domain | None = None) -> dg.Definitions:
    """Every Dagster object of a code location over `settings`, folding with `domain` (by default the modules
    ES_PIPELINE_DOMAIN names: `settings.domain_modules`)."""
    settings = settings or Settings.from_env()
    domain = domain if domain is not None else load_domain(settings.domain_modules)
    events = build_events_asset(slice_ranges_partitions(settings.slice_ranges), settings, domain)
    events_job = build_events_job(events)
    new_events_sensor = build_new_events_sensor(
        events_job, split(settings.slice_ranges), interval_seconds=settings.sensor_interval_seconds,
        tail_seconds=settings.tail_seconds,
    )
    return dg.Definitions(
        assets=[events, *build_projection_assets(domain), snapshots],
        asset_checks=CHECKS,
        jobs=[events_job, lake_checks_job, delta_maintenance_job, snapshots_job],
        sensors=[new_events_sensor, build_projections_automation_sensor(running=settings.automation, domain=domain)],
        schedules=[delta_maintenance_schedule, snapshots_schedule, lake_checks_schedule],
        resources=build_resources(settings),
        # Every job's steps in the run's own process unless it says otherwise: a hand materialization of a
        # range with its checks, or the projections' automation run, starts one Spark session, not one per step.
        executor=dg.in_process_executor,
    )

