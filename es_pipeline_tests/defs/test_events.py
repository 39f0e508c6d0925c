"""The Dagster layer against a real instance: materialize `events`, tick the sensor."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
from shop.domain import domain as SHOP

from es_pipeline.cli import main
from es_pipeline.defs.events.asset import build_events_asset
from es_pipeline.defs.events.partitions import slice_ranges_partitions
from es_pipeline.defs.events.sensor import tailing_request
from es_pipeline.dev.workload import run_workload
from es_pipeline.errors import SourceChanged, XidSpaceWentBack
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange, split
from es_pipeline.extraction.tail import RANGE_TAG, TAIL_TAG
from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog
from es_pipeline.lake.delta import tables
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.location import build_definitions
from es_pipeline.settings import Settings
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.lakecheck import assert_exactly_once, extract_all
from es_pipeline_tests.support.roles import StoreDsn


def _defs(settings: Settings, spark: Any) -> dg.Definitions:
    """Two ranges, one pass per run (the tailing sensor has its own test)."""
    return build_definitions(replace(settings, slice_ranges=2, tail_seconds=0), SHOP)


def test_sensor_requests_one_run_per_range_with_new_events_and_skips_when_none(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path
) -> None:
    defs = _defs(settings, spark)
    sensor = defs.resolve_sensor_def("new_events_sensor")
    with dg.instance_for_test() as instance:
        ctx = dg.build_sensor_context(instance=instance, resources={"event_store": defs.resources["event_store"]})
        result = sensor(ctx)
        assert isinstance(result, dg.SensorResult) and not result.run_requests
        run_workload(EventStore(dsn.writer), streams=200, events=400, writers=2, rollback_rate=0, max_commit_delay=0)
        ctx = dg.build_sensor_context(instance=instance, resources={"event_store": defs.resources["event_store"]})
        result = sensor(ctx)
        assert isinstance(result, dg.SensorResult)
        keys = sorted(r.partition_key for r in result.run_requests or [])
        assert keys == ["0000-0511", "0512-1023"]
        assert all(r.run_key and r.run_key.startswith(r.partition_key + ":") for r in result.run_requests or [])
        # Same horizon, cursor kept: no duplicate work.
        ctx2 = dg.build_sensor_context(
            instance=instance, cursor=result.cursor, resources={"event_store": defs.resources["event_store"]}
        )
        again = sensor(ctx2)
        assert isinstance(again, dg.SensorResult) and not again.run_requests


def test_sensor_read_failure_is_a_skip_with_the_reason(settings: Settings, spark: Any) -> None:
    defs = build_definitions(replace(settings, pg_dsn="postgresql://postgres@127.0.0.1:1/nowhere", slice_ranges=2))
    sensor = defs.resolve_sensor_def("new_events_sensor")
    with dg.instance_for_test() as instance:
        ctx = dg.build_sensor_context(instance=instance, resources={"event_store": defs.resources["event_store"]})
        result = sensor(ctx)
    assert isinstance(result, dg.SkipReason)
    assert "could not read the event store" in (result.skip_message or "")


def test_materializing_every_partition_puts_each_event_in_the_lake_once(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path
) -> None:
    run_workload(EventStore(dsn.writer), streams=100, events=600, writers=4, rollback_rate=0.1, max_commit_delay=0.01)
    defs = _defs(settings, spark)
    events = build_events_asset(slice_ranges_partitions(2), replace(settings, slice_ranges=2), SHOP)
    # The Spark resource's getOrCreate() returns the test session's one session: no second JVM.
    resources = dict(defs.resources)
    with dg.instance_for_test() as instance:
        for key in ("0000-0511", "0512-1023"):
            res = dg.materialize([events], partition_key=key, resources=resources, instance=instance)
            assert res.success
            meta = res.asset_materializations_for_node("events")[0].metadata
            assert isinstance(meta["dagster/row_count"].value, int)
            assert meta["events_behind_horizon"].value == 0
    assert assert_exactly_once(spark, warehouse, dsn) == 600


def test_a_store_never_migrated_fails_the_run_in_one_line(empty_dsn: str, warehouse: Path) -> None:
    settings = Settings.from_env({"ES_PIPELINE_PG_DSN": empty_dsn, "ES_PIPELINE_WAREHOUSE": str(warehouse),
                                  "ES_PIPELINE_SLICE_RANGES": "1"})
    settings = replace(settings, pg_dsn_from_env=False)  # the DSN as a value: no environment needed
    events = build_events_asset(slice_ranges_partitions(1), settings, SHOP)
    with dg.instance_for_test() as instance:
        res = dg.materialize([events], partition_key="0000-1023", resources=build_definitions(settings, SHOP).resources,
                             instance=instance, raise_on_error=False)
    assert not res.success
    failure = res.get_step_failure_events()[0].step_failure_data
    assert "not migrated" in (failure.user_failure_data.description or "")
    assert "es-pipeline db migrate" in (failure.user_failure_data.description or "")
    assert not warehouse.joinpath("events").exists()


def test_with_tailing_the_sensor_requests_one_run_over_every_range_and_the_next_as_it_ends(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path
) -> None:
    defs = build_definitions(replace(settings, slice_ranges=2, tail_seconds=60, sensor_interval_seconds=15), SHOP)
    sensor = defs.resolve_sensor_def("new_events_sensor")
    run_workload(EventStore(dsn.writer), streams=50, events=100, writers=1, rollback_rate=0, max_commit_delay=0)
    with dg.instance_for_test() as instance:
        resources = {"event_store": defs.resources["event_store"]}
        result = sensor(dg.build_sensor_context(instance=instance, resources=resources))
        assert isinstance(result, dg.SensorResult) and len(result.run_requests or []) == 1
        request = (result.run_requests or [])[0]
        assert request.partition_key_range == dg.PartitionKeyRange("0000-0511", "0512-1023")
        assert request.tags[TAIL_TAG] == "60" and request.tags[RANGE_TAG] == "0000-1023"
        instance.add_run(dg.DagsterRun(job_name="events_job", run_id="tailing", tags=request.tags,
                                       status=dg.DagsterRunStatus.STARTED))
        again = sensor(dg.build_sensor_context(instance=instance, resources=resources))
        assert isinstance(again, dg.SkipReason) and "tailing run is in progress" in (again.skip_message or "")
        # 5 s of its 60 left: the next run is requested now; it waits in the queue until this one ends.
        started = dg.DagsterEvent(event_type_value=dg.DagsterEventType.RUN_START.value, job_name="events_job")
        instance.run_storage.handle_run_event("tailing", started, datetime.now(UTC) - timedelta(seconds=55))
        handoff = sensor(dg.build_sensor_context(instance=instance, resources=resources))
        assert isinstance(handoff, dg.SensorResult) and len(handoff.run_requests or []) == 1
        instance.add_run(dg.DagsterRun(job_name="events_job", run_id="next", tags=request.tags,
                                       status=dg.DagsterRunStatus.NOT_STARTED))
        queued = sensor(dg.build_sensor_context(instance=instance, resources=resources))
        assert isinstance(queued, dg.SkipReason) and "queued" in (queued.skip_message or "")


def test_a_tailing_run_reports_its_passes_per_partition_with_their_own_rows(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path
) -> None:
    """A run over both ranges (as the sensor requests it), tailing 6 s: its first pass is reported at once, a
    pass after a later commit at the end (within ES_PIPELINE_REPORT_SECONDS of the first), each a materialization of the
    partitions it brought events to, with their own rows."""
    store = EventStore(dsn.writer)
    run_workload(store, streams=50, events=100, writers=1, rollback_rate=0, max_commit_delay=0)
    defs = _defs(settings, spark)
    events = build_events_asset(slice_ranges_partitions(2), replace(settings, slice_ranges=2), SHOP)
    tags = {**tailing_request(split(2), 0, 6).tags}
    later = threading.Timer(3.0, lambda: run_workload(store, streams=50, events=40, writers=1, rollback_rate=0,
                                                      max_commit_delay=0))
    with dg.instance_for_test() as instance:
        later.start()
        res = dg.materialize([events], resources=dict(defs.resources), instance=instance, tags=tags)
        later.join()
        assert res.success
        passes = [e.step_materialization_data.materialization for e in res.all_events
                  if e.is_step_materialization and "last_pass" in e.step_materialization_data.materialization.metadata]
    rows = {(m.metadata["last_pass"].value, m.partition): m.metadata["rows"].value for m in passes}
    by_pass = {p: sum(n for (q, _), n in rows.items() if q == p) for p, _ in rows}
    assert by_pass == {1: 100, 2: 40}, rows
    assert {part for _, part in rows} == {"0000-0511", "0512-1023"}
    assert assert_exactly_once(spark, warehouse, dsn) == 140


def test_a_tailing_run_keeps_the_projections_fresh_without_spark(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path
) -> None:
    """Once Spark has built the projections, a tailing run folds each pass's events into them itself
    (small increments, delta-rs), each update a materialization of that projection, and each of them
    reported once more after the run's own materialization of `events`."""
    store = EventStore(dsn.writer)
    run_workload(store, streams=20, events=60, writers=1, rollback_rate=0, max_commit_delay=0)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    update_stream_catalog(Engine(spark=spark), warehouse)
    update_event_type_daily(Engine(spark=spark), warehouse)
    events = build_events_asset(slice_ranges_partitions(2), replace(settings, slice_ranges=2, automation=True), SHOP)
    later = threading.Timer(2.0, lambda: run_workload(store, streams=20, events=40, writers=1, rollback_rate=0,
                                                      max_commit_delay=0))
    with dg.instance_for_test() as instance:
        later.start()
        res = dg.materialize([events], resources=dict(_defs(settings, spark).resources), instance=instance,
                             tags=tailing_request(split(2), 0, 8).tags)
        later.join()
        assert res.success
        reported = [e.step_materialization_data.materialization for e in res.all_events if e.is_step_materialization]
    kept = [m for m in reported if "kept_by" in m.metadata]
    assert {m.asset_key.to_user_string() for m in kept} == {"stream_state", "stream_catalog", "event_type_daily"}
    # Each reported after the run's own (last) materialization of events: the automation sees them not behind it.
    order = [m.asset_key.to_user_string() for m in reported]
    assert set(order[max(i for i, key in enumerate(order) if key == "events") + 1:]) == {
        "stream_state", "stream_catalog", "event_type_daily"}, order
    folded = sum(m.metadata["events_folded"].value for m in kept if m.asset_key.to_user_string() == "stream_state")
    assert folded == 40
    catalog = tables.read(spark, str(warehouse / "stream_catalog")).agg({"events": "sum"}).first()[0]
    assert catalog == 100


def test_the_sensor_asks_again_after_a_run_failed_at_the_same_horizon(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a quiet store the horizon stands still: after a failed run the cursor and the run key (Dagster runs a key
    once) would keep the range's committed events waiting for ever. The sensor asks again, under a new key."""
    from dagster._core.test_utils import create_run_for_test

    from es_pipeline.defs.events import sensor as sensor_module

    monkeypatch.setattr(sensor_module, "RETRY_AFTER_SECONDS", 0.0)
    defs = _defs(settings, spark)
    sensor = defs.resolve_sensor_def("new_events_sensor")
    run_workload(EventStore(dsn.writer), streams=50, events=100, writers=1, rollback_rate=0, max_commit_delay=0)
    with dg.instance_for_test() as instance:
        def tick(cursor: str | None) -> dg.SensorResult:
            result = sensor(dg.build_sensor_context(instance=instance, cursor=cursor,
                                                    resources={"event_store": defs.resources["event_store"]}))
            assert isinstance(result, dg.SensorResult)
            return result

        first = tick(None)
        asked = {r.partition_key: r for r in first.run_requests or []}
        assert sorted(asked) == ["0000-0511", "0512-1023"]
        horizon = asked["0000-0511"].tags["es_pipeline/horizon"]
        assert not tick(first.cursor).run_requests, "same horizon: asked already"
        failed = create_run_for_test(instance, job_name="events_job", status=dg.DagsterRunStatus.FAILURE,
                                     tags={RANGE_TAG: "0000-0511", "es_pipeline/horizon": horizon})
        again = tick(first.cursor).run_requests or []
        assert [(r.partition_key, r.run_key) for r in again] == [
            ("0000-0511", f"0000-0511:{horizon}:after-{failed.run_id[:8]}")]


def test_ids_gone_back_or_another_cluster_stop_the_run_the_sensor_and_status(
    dsn: StoreDsn, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What `pg_resetwal -x` or a logical replica does to the ids, and what a restore does to the identity,
    simulated on the offsets: every path says so instead of reporting "caught up"."""
    run_workload(EventStore(dsn), streams=30, events=100, writers=2, rollback_rate=0, max_commit_delay=0, seed=1)
    Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))
    defs = build_definitions(replace(Settings.from_env(), pg_dsn=dsn.extractor, warehouse=warehouse, slice_ranges=2))
    sensor = defs.resolve_sensor_def("new_events_sensor")
    monkeypatch.setenv("ES_PIPELINE_PG_DSN", dsn.extractor)
    monkeypatch.setenv("ES_PIPELINE_WAREHOUSE", str(warehouse))
    cases = [
        ("UPDATE es_pipeline.offsets SET watermark = (pg_snapshot_xmin(pg_current_snapshot())::text::bigint + 5000)"
         "::text::xid8 WHERE slice = 7", XidSpaceWentBack, "above the horizon"),
        ("UPDATE es_pipeline.sinks SET source_cluster = '1234567890'", SourceChanged, "cluster 1234567890"),
    ]
    for statement, error, words in cases:
        with psycopg.connect(dsn, autocommit=True) as conn:
            saved = conn.execute("SELECT slice, watermark::text FROM es_pipeline.offsets").fetchall()
            conn.execute(statement)
        with pytest.raises(error, match=words):
            Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))
        with dg.instance_for_test() as instance:
            tick = sensor(dg.build_sensor_context(instance=instance, resources={"event_store": defs.resources["event_store"]}))
        assert isinstance(tick, dg.SkipReason) and "no run was requested" in (tick.skip_message or "")
        assert words in (tick.skip_message or "")
        assert main(["status"]) == 2 and words in capsys.readouterr().err
        with psycopg.connect(dsn, autocommit=True) as conn:  # put the offsets back for the next case
            conn.execute("UPDATE es_pipeline.sinks SET source_cluster = (SELECT system_identifier::text FROM pg_control_system())")
            for s, w in saved:
                conn.execute("UPDATE es_pipeline.offsets SET watermark = %s::xid8 WHERE slice = %s", (w, s))
