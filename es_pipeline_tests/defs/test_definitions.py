"""The code location loads with the assets, checks, sensors and schedules the design names."""

from __future__ import annotations

import dagster as dg

from es_pipeline.definitions import defs


def test_defs_load_with_the_designed_names() -> None:
    keys = {k.to_user_string() for k in defs.resolve_all_asset_keys()}
    assert keys == {"events", "stream_catalog", "event_type_daily", "stream_state", "snapshots"}
    checks = {k.name for k in defs.resolve_asset_graph().asset_check_keys}
    assert checks == {"events_no_duplicates", "events_versions_contiguous", "events_reconcile_with_source",
                      "stream_state_version_matches_events", "snapshots_match_store"}
    assert {s.name for s in defs.sensors} == {"new_events_sensor", "projections_automation_sensor"}
    assert {s.name for s in defs.schedules} == {"delta_maintenance_schedule", "snapshots_schedule", "lake_checks_schedule"}
    events = defs.resolve_assets_def("events")
    assert isinstance(events.partitions_def, dg.StaticPartitionsDefinition)
    assert events.partitions_def.get_partition_keys()[:2] == ["0000-0127", "0128-0255"]
