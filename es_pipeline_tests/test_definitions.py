"""The code location loads with the assets, checks, sensors and schedules the design names."""

from __future__ import annotations

import dagster as dg

from es_pipeline.definitions import defs


def test_defs_load_with_the_designed_names() -> None:
    keys = {k.to_user_string() for k in defs.resolve_all_asset_keys()}
    assert {"events"} <= keys
    events = defs.resolve_assets_def("events")
    assert isinstance(events.partitions_def, dg.StaticPartitionsDefinition)
    assert events.partitions_def.get_partition_keys()[:2] == ["0000-0127", "0128-0255"]
