"""The automation sensor that keeps the projections after `events` (declarative automation)."""

import dagster as dg

from es_pipeline.defs.projections.assets import NAMES
from es_pipeline.domain import Domain

# Seconds between the automation's evaluations: the tailing run keeps the projections' small increments itself, so
# the automation takes first builds, what needs Spark and what a follow left; each evaluation costs the daemon and
# the code server (docs/decisions/0045). The exporter's sensor-stalled figure knows it (health/exporter.py).
AUTOMATION_INTERVAL = 60


def build_projections_automation_sensor(
    *, running: bool, domain: Domain | None = None
) -> dg.AutomationConditionSensorDefinition:
    """On by default; `ES_PIPELINE_AUTOMATION=off` leaves it stopped (the end-to-end extraction test does).
    Its target: the built-in projections and `domain`'s cross-stream ones."""
    return dg.AutomationConditionSensorDefinition(
        "projections_automation_sensor",
        target=dg.AssetSelection.assets(*NAMES, *sorted(domain.projections if domain else ())),
        default_status=dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED,
        minimum_interval_seconds=AUTOMATION_INTERVAL,
        description="Declarative automation of the projections: they update after `events` does.",
    )
