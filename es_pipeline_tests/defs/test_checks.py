"""The library's checks as Dagster asset checks (defs/checks.py): one per declaration, scoped to a partition beside
its materialization, and the stream_state check gating the snapshots' write-back. What each check finds, on both
engines and on broken lakes: es_pipeline_tests/checks/test_checks.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import dagster as dg
from shop.domain import domain as SHOP

from es_pipeline import checks
from es_pipeline.defs.checks import EVENTS_CHECKS
from es_pipeline.defs.events.asset import build_events_asset
from es_pipeline.defs.events.partitions import slice_ranges_partitions
from es_pipeline.defs.resources import EventStoreResource, SparkResource, WarehouseResource
from es_pipeline.dev.workload import run_workload
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.lake.delta import tables
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.spark import spark_conf
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.location import build_definitions
from es_pipeline.settings import Settings
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.roles import StoreDsn


def _resources(s: Settings, engine: str = "auto") -> dict[str, Any]:
    return {
        "spark": SparkResource(spark_config=spark_conf(s)),
        "warehouse": WarehouseResource(path=str(s.warehouse), engine=engine),
        "event_store": EventStoreResource(dsn=s.pg_dsn),
    }


def test_every_check_of_the_library_is_an_asset_check_of_the_location(settings: Settings) -> None:
    graph = build_definitions(settings, SHOP).resolve_asset_graph()
    found = {key.name: (key.asset_key.to_user_string(), graph.get_check_spec(key).blocking)
             for key in graph.asset_check_keys}
    assert found == {c.name: (c.table, c.blocking) for c in checks.every_check(SHOP)}


def test_checks_beside_a_partitions_materialization_check_that_partition_only(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path
) -> None:
    """A hand materialization of one range runs the events checks over that range's slices (what it costs is
    the range's, not the table's); on their schedule, with no partition, they check every slice."""
    run_workload(EventStore(dsn.writer), streams=60, events=400, writers=2, rollback_rate=0, max_commit_delay=0)
    two = replace(settings, slice_ranges=2)
    events = build_events_asset(slice_ranges_partitions(2), two, SHOP)
    instance = dg.DagsterInstance.ephemeral()
    first = dg.materialize([events, *EVENTS_CHECKS], partition_key="0000-0511", resources=_resources(two),
                           instance=instance)
    evaluations = first.get_asset_check_evaluations()
    assert sorted(e.check_name for e in evaluations) == sorted(c.name for c in checks.events.CHECKS)
    assert all(e.passed and e.metadata["scope"].value == "slices 0000-0511" for e in evaluations)
    assert all(e.metadata["engine"].value == "local" for e in evaluations), "a range's checks start no JVM"
    reconcile = next(e for e in evaluations if e.check_name == "events_reconcile_with_source")
    lower = tables.read(spark, str(warehouse / "events")).where("slice <= 511").count()
    assert reconcile.metadata["lake_events"].value == lower > 0

    # A row of the other range duplicated: that range's check and the table-wide one see it, this range's not.
    events_path = str(warehouse / "events")
    dg.materialize([events], partition_key="0512-1023", resources=_resources(two), instance=instance)
    tables.read(spark, events_path).where("slice >= 512").limit(1).write.format("delta").mode("append").save(events_path)
    again = dg.materialize([events, *EVENTS_CHECKS], partition_key="0000-0511", resources=_resources(two),
                           instance=instance)
    assert all(e.passed for e in again.get_asset_check_evaluations())
    other = dg.materialize([events, *EVENTS_CHECKS], partition_key="0512-1023", resources=_resources(two),
                           instance=instance, raise_on_error=False)
    failed = {e.check_name for e in other.get_asset_check_evaluations() if not e.passed}
    assert failed == {"events_no_duplicates", "events_reconcile_with_source"}
    whole = build_definitions(two, SHOP).resolve_job_def("lake_checks_job").execute_in_process(
        instance=instance, raise_on_error=False)
    by_name = {e.check_name: e for e in whole.get_asset_check_evaluations()}
    assert not by_name["events_no_duplicates"].passed, "table-wide, it is seen too"
    assert by_name["events_no_duplicates"].metadata["scope"].value == "every slice"


def test_a_stream_state_off_its_events_stops_the_snapshots_write_back(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path
) -> None:
    """The stream_state check is blocking and in `snapshots_job`: with the state off, nothing is written back."""
    run_workload(EventStore(dsn.writer), streams=20, events=100, writers=1, rollback_rate=0, max_commit_delay=0)
    Extractor(settings.pg_dsn, spark, warehouse).run(SliceRange(0, 1023))
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    spark.sql(f"UPDATE delta.`{warehouse / 'stream_state'}` SET version = version - 1")
    job = build_definitions(replace(settings, spark_master="local[2]"), SHOP).resolve_job_def("snapshots_job")
    result = job.execute_in_process(instance=dg.DagsterInstance.ephemeral(), raise_on_error=False)
    assert not result.success
    check = next(e for e in result.get_asset_check_evaluations())
    assert check.check_name == "stream_state_version_matches_events" and not check.passed
    assert check.metadata["read_with"].value == "arrow"
    assert "snapshots" not in {e.step_key for e in result.get_step_success_events()}
    assert EventStore(dsn).snapshot_keys() == []
