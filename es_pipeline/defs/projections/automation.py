"""The automation sensor that keeps the projections after `events` (declarative automation)."""

import dagster as dg

from es_pipeline.defs.projections.assets import NAMES
from es_pipeline.domain import Domain


def build_projections_automation_sensor(
    *, running: bool, domain: Domain | None = None
) -> dg.AutomationConditionSensorDefinition:
    """On by default; `ES_PIPELINE_AUTOMATION=off` leaves it stopped (the end-to-end extraction test does).
    Its target: the built-in projections and `domain`'s cross-stream ones."""
    return dg.AutomationConditionSensorDefinition(
        "projections_automation_sensor",
        target=dg.AssetSelection.assets(*NAMES, *sorted(domain.projections if domain else ())),
        default_status=dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED,
        minimum_interval_seconds=30,
        description="Declarative automation of the projections: they update after `events` does.",
    )
