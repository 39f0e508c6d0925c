"""The automation sensor that keeps the projections after `events` (declarative automation)."""

import dagster as dg

from es_pipeline.defs.projections.assets import NAMES


def build_projections_automation_sensor(*, running: bool) -> dg.AutomationConditionSensorDefinition:
    """On by default; `ES_PIPELINE_AUTOMATION=off` leaves it stopped (the end-to-end extraction test does)."""
    return dg.AutomationConditionSensorDefinition(
        "projections_automation_sensor",
        target=dg.AssetSelection.assets(*NAMES),
        default_status=dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED,
        minimum_interval_seconds=30,
        description="Declarative automation of the projections: they update after `events` does.",
    )
