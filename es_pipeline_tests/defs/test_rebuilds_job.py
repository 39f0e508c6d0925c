"""The rebuilds beside `stream_state` through Dagster (defs/projections/rebuilds.py): the `stream_state` asset's
run folds every other type and ends; the sensor sees the type waiting and requests `stream_state_rebuilds_job`,
whose run swaps it in; then the sensor skips. The lake equals a fold of the store."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import dagster as dg
import pytest
from shop.domain import domain as SHOP

from es_pipeline.dev.workload import run_workload
from es_pipeline.location import build_definitions
from es_pipeline.settings import Settings
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.lake.test_rebuild import bumped, lake_states, store_states
from es_pipeline_tests.support.lakecheck import extract_all
from es_pipeline_tests.support.roles import StoreDsn


@pytest.mark.slow  # two workloads, three Dagster runs: `make test`, not `make check`'s budget
def test_the_asset_run_holds_the_type_back_and_the_sensors_job_swaps_it_in(
    dsn: StoreDsn, settings: Settings, warehouse: Path
) -> None:
    store = EventStore(dsn.writer)
    run_workload(store, streams=30, events=200, writers=2, rollback_rate=0.1, max_commit_delay=0.01, seed=91)
    extract_all(dsn.extractor, None, warehouse)
    first = build_definitions(settings, SHOP)
    with dg.instance_for_test() as instance:
        assert first.resolve_job_def("__ASSET_JOB").execute_in_process(
            instance=instance, asset_selection=[dg.AssetKey("stream_state")]).success
        sensor = first.resolve_sensor_def("stream_state_rebuilds_sensor")
        context = dg.build_sensor_context(instance=instance, resources={"warehouse": first.resources["warehouse"]})
        assert isinstance(sensor(context), dg.SkipReason)

        two = bumped(SHOP, 2)
        defs = build_definitions(replace(settings, rebuilds="beside"), two)
        run_workload(store, streams=30, events=100, writers=2, rollback_rate=0.1, max_commit_delay=0.01, seed=92)
        extract_all(dsn.extractor, None, warehouse)
        run = defs.resolve_job_def("__ASSET_JOB").execute_in_process(
            instance=instance, asset_selection=[dg.AssetKey("stream_state")])
        assert run.success
        (materialized,) = run.asset_materializations_for_node("stream_state")
        assert materialized.metadata["rebuilding_types"].value == "cart"  # held back, left to the job
        now = lake_states(warehouse)
        assert {k: v for k, v in now.items() if not k.startswith("cart-")} == \
            {k: v for k, v in store_states(dsn, two).items() if not k.startswith("cart-")}

        sensor = defs.resolve_sensor_def("stream_state_rebuilds_sensor")
        context = dg.build_sensor_context(instance=instance, resources={"warehouse": defs.resources["warehouse"]})
        request = sensor(context)
        assert isinstance(request, dg.RunRequest) and request.tags["es_pipeline/rebuild"] == "cart"
        assert defs.resolve_job_def("stream_state_rebuilds_job").execute_in_process(instance=instance).success
        assert lake_states(warehouse) == store_states(dsn, two)
        context = dg.build_sensor_context(instance=instance, resources={"warehouse": defs.resources["warehouse"]})
        assert isinstance(sensor(context), dg.SkipReason)
