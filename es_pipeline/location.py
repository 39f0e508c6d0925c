"""Every Dagster object of an es_pipeline code location, assembled from `defs/`: `build_definitions`.

Explicit rather than autoloaded: the partitions, the sensor's interval, the automation switch and the
`events` asset's writer come from `Settings`, and the reducers from a `Domain`, so
`build_definitions(settings, domain)` builds all of it. es_pipeline's own code location
(`es_pipeline.definitions`) and a team's (examples/shop/shop/definitions.py) both call it.
"""

from datetime import timedelta

import dagster as dg

from es_pipeline.defs.catalog import build_catalog_sensor, catalog, catalog_job
from es_pipeline.defs.checks import build_asset_checks
from es_pipeline.defs.events.asset import build_events_asset, build_events_job
from es_pipeline.defs.events.partitions import slice_ranges_partitions
from es_pipeline.defs.events.sensor import build_new_events_sensor
from es_pipeline.defs.health.sensor import build_run_failure_alert
from es_pipeline.defs.maintenance.jobs import delta_maintenance_job, lake_checks_job
from es_pipeline.defs.maintenance.schedules import delta_maintenance_schedule, lake_checks_schedule
from es_pipeline.defs.projections.assets import build_projection_assets
from es_pipeline.defs.projections.automation import build_projections_automation_sensor
from es_pipeline.defs.projections.rebuilds import JOB as REBUILDS_JOB  # noqa: F401 - for the command line (project.py)
from es_pipeline.defs.projections.rebuilds import build_rebuilds_job, build_rebuilds_sensor
from es_pipeline.defs.resources import build_resources
from es_pipeline.defs.snapshots.asset import snapshots
from es_pipeline.defs.snapshots.schedule import snapshots_job, snapshots_schedule
from es_pipeline.domain import Domain
from es_pipeline.extraction.slices import split
from es_pipeline.settings import Settings

SNAPSHOTS_FRESHNESS_SECONDS = 1800  # at least: the snapshots' schedule runs every ten minutes


def with_freshness(assets: list[dg.AssetsDefinition], settings: Settings) -> list[dg.AssetsDefinition]:
    """Every lake asset with a freshness policy (Dagster's freshness daemon evaluates it, the UI shows it):
    failed when not materialized for ES_PIPELINE_FRESHNESS_SECONDS (15 min), warned at half of it; the
    snapshots at least every 30 minutes. A tailing run materializes `events` and the projections it keeps at
    least once per run even when no event came (they were checked up to date), so an idle store stays fresh;
    with one pass per run (ES_PIPELINE_TAIL_SECONDS=0) nothing materializes an idle store's assets, and they go
    stale: docs/operations.md."""

    def policy(seconds: int) -> dg.FreshnessPolicy:
        warn = timedelta(seconds=seconds / 2)  # Dagster takes no window under a minute
        return dg.FreshnessPolicy.time_window(fail_window=timedelta(seconds=seconds),
                                              warn_window=warn if warn >= timedelta(minutes=1) else None)

    lake, snapshots_policy = policy(settings.freshness_seconds), policy(
        max(settings.freshness_seconds, SNAPSHOTS_FRESHNESS_SECONDS))
    return dg.map_asset_specs(  # type: ignore[return-value]
        lambda spec: dg.apply_freshness_policy(spec, snapshots_policy if spec.key == dg.AssetKey("snapshots") else lake),
        assets)


def build_definitions(settings: Settings | None = None, domain: Domain | None = None) -> dg.Definitions:
    """Every Dagster object of a code location over `settings`, folding with `domain` (by default the modules
    ES_PIPELINE_DOMAIN names: `settings.domain_modules`)."""
    settings = settings or Settings.from_env()
    domain = domain if domain is not None else settings.load_domain()
    events = build_events_asset(slice_ranges_partitions(settings.slice_ranges), settings, domain)
    events_job = build_events_job(events)
    new_events_sensor = build_new_events_sensor(
        events_job, split(settings.slice_ranges), interval_seconds=settings.sensor_interval_seconds,
        tail_seconds=settings.tail_seconds,
    )
    rebuilds_job = build_rebuilds_job(domain)
    return dg.Definitions(
        assets=[*with_freshness([events, *build_projection_assets(domain), snapshots], settings), catalog],
        asset_checks=build_asset_checks(domain),
        jobs=[events_job, lake_checks_job, delta_maintenance_job, snapshots_job, rebuilds_job, catalog_job],
        sensors=[new_events_sensor, build_projections_automation_sensor(running=settings.automation, domain=domain),
                 build_run_failure_alert(),
                 build_rebuilds_sensor(rebuilds_job, domain, running=settings.rebuilds == "beside"),
                 build_catalog_sensor(running=settings.automation)],
        schedules=[delta_maintenance_schedule, snapshots_schedule, lake_checks_schedule],
        resources=build_resources(settings),
        # Every job's steps in the run's own process unless it says otherwise: a hand materialization of a
        # range with its checks, or the projections' automation run, starts one Spark session, not one per step.
        executor=dg.in_process_executor,
    )

