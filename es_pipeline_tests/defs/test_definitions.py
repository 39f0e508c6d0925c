"""The code location loads with the assets, checks, sensors and schedules the design names."""

from __future__ import annotations

import dagster as dg

from es_pipeline.definitions import defs
from es_pipeline.health import dagster_state


def test_defs_load_with_the_designed_names() -> None:
    keys = {k.to_user_string() for k in defs.resolve_all_asset_keys()}
    assert keys == {"events", "stream_catalog", "event_type_daily", "stream_state", "event_tables", "snapshots",
                    "catalog"}
    checks = {k.name for k in defs.resolve_asset_graph().asset_check_keys}
    assert checks == {"events_no_duplicates", "events_versions_contiguous", "events_reconcile_with_source",
                      "stream_state_version_matches_events", "snapshots_match_store", "catalog_matches_lake",
                      "stream_catalog_matches_events", "event_type_daily_matches_events"}
    # The exporter reads every one of them (and one per cross-stream projection: the next test).
    assert {c for _, c in dagster_state.checks_of(sorted(keys))} == checks
    assert {s.name for s in defs.sensors} == {"new_events_sensor", "projections_automation_sensor", "run_failure_alert",
                                              "stream_state_rebuilds_sensor", "catalog_sensor"}
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
            if key == dg.AssetKey("catalog"):  # names, not a table: its own check and alert say when it is off
                continue
            policy = built.resolve_assets_def(key).specs_by_key[key].freshness_policy
            assert policy is not None and policy.fail_window.to_timedelta().total_seconds() >= seconds, key


def test_the_projections_follow_events_while_a_tailing_run_is_in_progress() -> None:
    """Plain `eager()` waits while any dependency is in progress, and a tailing `events` run always is:
    the projections would never update. Theirs does not wait for it."""
    from es_pipeline.defs.projections.assets import AFTER_EVENTS, build_projection_assets
    from es_pipeline.domain import NO_DOMAIN

    waits = ~dg.AutomationCondition.any_deps_in_progress()
    assert waits in dg.AutomationCondition.eager().children and waits not in AFTER_EVENTS.children
    assert all(a.automation_conditions_by_key[a.key] == AFTER_EVENTS for a in build_projection_assets(NO_DOMAIN))


def test_a_projection_behind_events_is_requested_even_when_it_was_updated_in_the_same_evaluation() -> None:
    """The automation's evaluations on a real (ephemeral) Dagster instance, over the real definitions: each
    step reports materializations as a tailing run does (`events`' report, then the follow's of
    `stream_state`), then evaluates. The case plain `eager()` misses (its own update in the same evaluation
    wins): a follow reported, then `events` again with an event the follow could not fold (a reducer raising;
    a held horizon then stops every later update of `events`): `stream_state` must be requested once, and
    again only when `events` updates."""
    import time

    instance = dg.DagsterInstance.ephemeral()
    state = dg.AssetKey("stream_state")
    partitions = defs.resolve_assets_def("events").partitions_def.get_partition_keys()  # type: ignore[union-attr]
    first, second = partitions[:2]
    cursor = None

    def report(key: str, partition: str | None = None) -> None:
        instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=key, partition=partition))
        time.sleep(0.01)  # the order the automation compares is the timestamps'

    def requested() -> int:
        nonlocal cursor
        result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor,
                                                   asset_selection=dg.AssetSelection.assets(state))
        cursor = result.cursor
        return result.get_num_requested(state)

    assert requested() == 0  # no events yet
    for partition in partitions:
        report("events", partition)
    assert requested() == 1  # the first build
    assert requested() == 0  # its run in flight: not again
    report("stream_state")
    assert requested() == 0
    report("events", first), report("stream_state")
    assert requested() == 0  # a report of events, its follow after it: kept up
    report("events", first), report("stream_state"), report("events", second)
    assert requested() == 1  # behind: what eager() misses
    assert requested() == 0  # its run failed, and nothing new: not tried every minute
    report("events", first)
    assert requested() == 1  # events updated again: tried again
    report("stream_state"), report("events", second)
    assert requested() == 1  # its run done, then events updated, both before the next evaluation: asked again
    report("stream_state")
    assert requested() == 0
    report("events", second)
    assert requested() == 1  # an events run that does not follow (not tailing)


def test_a_domain_named_with_spaces_and_symbols_loads_its_cross_stream_projection() -> None:
    """The asset's `domain` tag is the name as a Dagster tag value takes it; the name itself is the team's."""
    from es_pipeline.domain import Domain, Event, State
    from es_pipeline.location import build_definitions

    team = Domain("my shop (EU) — 2026")

    @team.projection("sales_by_sku", events=["ItemAdded"], key="sku", revision=1)
    def sales_by_sku(state: State, event: Event) -> State:
        return {"n": int(state.get("n", 0)) + 1}

    graph = build_definitions(domain=team).resolve_asset_graph()
    node = graph.get(dg.AssetKey("sales_by_sku"))
    assert node.tags["domain"] == "my_shop__EU____2026"
