"""The code location: `es_pipeline.definitions:defs` (DESIGN §4)."""

from __future__ import annotations

import dagster as dg

from es_pipeline.assets.events import build_events_asset
from es_pipeline.partitions import slice_ranges_partitions
from es_pipeline.resources import build_resources
from es_pipeline.settings import Settings


def build_definitions(settings: Settings | None = None) -> dg.Definitions:
    settings = settings or Settings.from_env()
    partitions = slice_ranges_partitions(settings.slice_ranges)
    events = build_events_asset(partitions)
    return dg.Definitions(
        assets=[events],
        resources=build_resources(settings),
    )


defs = build_definitions()
