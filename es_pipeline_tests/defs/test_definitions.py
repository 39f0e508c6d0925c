"""The code location loads with the assets, checks, sensors and schedules the design names."""

from __future__ import annotations

import dagster as dg

from es_pipeline.definitions import defs
from es_pipeline.health import dagster_state


def test_defs_load_with_the_designed_names() -> None:
    keys = {k.to_user_string() for k in defs.resolve_all_asset_keys()}
    assert keys == {"events", "stream_catalog", "event_type_daily", "stream_state", "event_tables", "snapshots"}
    checks = {k.name for k in defs.resolve_asset_graph().asset_check_keys}
    assert checks == {"events_no_duplicates", "events_versions_contiguous", "events_reconcile_with_source",
                      "stream_state_version_matches_events", "snapshots_match_store",
                      "stream_catalog_matches_events", "event_type_daily_matches_events"}
    # The exporter reads every one of them (and one per cross-stream projection: the next test).
    assert {c for _, c in dagster_state.checks_of(sorted(keys))} == checks
    assert {s.name for s in defs.sensors} == {"new_events_sensor", "projections_automation_sensor", "run_failure_alert",
                                              "stream_state_rebuilds_sensor"}
    assert {s.name for s in defs.schedules} == {"delta_maintenance_schedule", "snapshots_schedule", "lake_checks_schedule"}
    events = defs.resolve_assets_def("events")
    assert isinstance(events.partitions_def, dg.StaticPartitionsDefinition)
    assert events.partitions_def.get_partition_keys()[:2] == ["0000-0127", "0128-0255"]



def test_a_teams_cross_stream_projection_gets_a_check_that_lake_checks_job_runs_and_the_exporter_reads() -> None:
    from shop.domain import domain as shop

    from es_pipeline.location import build_definitions

    team = build_definitions(domain=shop)
    graph = team.resolve_asset_graph()
    checks = {(k.asset_key.to_user_string(), k.name) for k in graph.asset_check_keys}
    assert ("sku_sales", "sku_sales_matches_events") in checks
    assert set(dagster_state.checks_of(sorted(k.to_user_string() for k in graph.get_all_asset_keys()))) == checks
    job = team.resolve_job_def("lake_checks_job")
    assert dg.AssetCheckKey(dg.AssetKey("sku_sales"), "sku_sales_matches_events") in job.asset_layer.asset_graph.asset_check_keys

def test_every_lake_asset_has_a_freshness_policy_even_at_the_shortest_window() -> None:
    from dataclasses import replace

    from es_pipeline.location import build_definitions
    from es_pipeline.settings import Settings

    for seconds in (60, 900):
        built = build_definitions(replace(Settings.from_env(), freshness_seconds=seconds))
        for key in built.resolve_all_asset_keys():
            policy = built.resolve_assets_def(key).specs_by_key[key].freshness_policy
            assert policy is not None and policy.fail_window.to_timedelta().total_seconds() >= seconds, key


def test_the_projections_follow_events_while_a_tailing_run_is_in_progress() -> None:
    """Plain `eager()` waits while any dependency is in progress, and a tailing `events` run always is:
    the projections would never update. Theirs is eager without that wait, the rest of it kept."""
    from es_pipeline.defs.projections.assets import AFTER_EVENTS, build_projection_assets
    from es_pipeline.domain import NO_DOMAIN

    eager = dg.AutomationCondition.eager()
    waits = ~dg.AutomationCondition.any_deps_in_progress()
    assert waits in eager.children and waits not in AFTER_EVENTS.children
    assert [c for c in eager.children if c != waits] == list(AFTER_EVENTS.children)
    assert all(a.automation_conditions_by_key[a.key] == AFTER_EVENTS for a in build_projection_assets(NO_DOMAIN))
