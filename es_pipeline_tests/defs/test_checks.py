"""Asset checks have teeth: they fail on a broken table and pass on a good one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.defs.events import checks as events_checks
from es_pipeline.defs.maintenance.jobs import CHECKS
from es_pipeline.defs.projections import checks as projections_checks
from es_pipeline.defs.resources import EventStoreResource, SparkResource, WarehouseResource
from es_pipeline.dev.workload import run_workload
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.lake import cross_stream
from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog
from es_pipeline.lake.delta import pieces, tables
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


def _run(check: Any, r: dict[str, Any]) -> dg.AssetCheckResult:
    names = check.node_def.required_resource_keys if hasattr(check, "node_def") else set()
    args = [dg.build_asset_check_context()] if _takes_context(check) else []
    return check(*args, **{k: v for k, v in r.items() if k in names})


def _takes_context(check: Any) -> bool:
    import inspect

    return "context" in inspect.signature(check.node_def.compute_fn.decorated_fn).parameters


@pytest.mark.parametrize("engine", ["auto", "pieces", "spark"])
def test_checks_pass_on_a_good_lake_and_fail_on_broken_ones(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On either engine: `auto` checks a small lake in this process (DataFusion, Arrow), `pieces` the same in five
    spans of slices (lake/delta/pieces.py, as a lake past a piece's bytes is), `spark` on Spark."""
    run_workload(EventStore(dsn.writer), streams=40, events=300, writers=2, rollback_rate=0, max_commit_delay=0)
    Extractor(settings.pg_dsn, spark, warehouse).run(SliceRange(0, 1023))
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    if engine == "pieces":
        monkeypatch.setattr(pieces, "PIECE_BYTES", tables.files_bytes(DeltaTable(str(warehouse / "events"))) // 5 + 1)
        engine = "auto"
    r = _resources(settings, engine)
    in_process_only = {f"{name}_matches_events" for name in SHOP.projections}  # cross-stream: no Spark path
    for check in CHECKS:
        result = _run(check, r)
        assert result.passed, check.check_key.name
        if "engine" in result.metadata:
            spark_expected = engine == "spark" and check.check_key.name not in in_process_only
            assert result.metadata["engine"].value == ("spark" if spark_expected else "local"), check.check_key.name

    events = str(warehouse / "events")
    df = tables.read(spark, events)
    victim = df.where("version = 1").orderBy("stream_id").first()
    # A duplicate row: the duplicate check fails; reconcile fails too (one more than the source).
    df.where(f"stream_id = '{victim['stream_id']}' AND version = 1").write.format("delta").mode("append").save(events)
    assert not _run(events_checks.events_no_duplicates, r).passed
    assert not _run(events_checks.events_reconcile_with_source, r).passed
    # A lost row below the watermark: contiguity and reconcile fail.
    spark.sql(f"DELETE FROM delta.`{events}` WHERE stream_id = '{victim['stream_id']}' AND version = 1")
    assert _run(events_checks.events_no_duplicates, r).passed
    assert not _run(events_checks.events_versions_contiguous, r).passed
    assert not _run(events_checks.events_reconcile_with_source, r).passed
    # A stream_state row behind its events.
    spark.sql(f"UPDATE delta.`{warehouse / 'stream_state'}` SET version = version - 1 WHERE stream_id = '{victim['stream_id']}'")
    assert not _run(projections_checks.stream_state_version_matches_events, r).passed


def test_checks_beside_a_partitions_materialization_check_that_partition_only(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path
) -> None:
    """A hand materialization of one range runs the events checks over that range's slices (what it costs is
    the range's, not the table's); on their schedule, with no partition, they check every slice."""
    from dataclasses import replace

    from es_pipeline.defs.events.asset import build_events_asset
    from es_pipeline.defs.events.partitions import slice_ranges_partitions

    run_workload(EventStore(dsn.writer), streams=60, events=400, writers=2, rollback_rate=0, max_commit_delay=0)
    two = replace(settings, slice_ranges=2)
    events = build_events_asset(slice_ranges_partitions(2), two, SHOP)
    checks = list(events_checks.CHECKS)
    instance = dg.DagsterInstance.ephemeral()
    first = dg.materialize([events, *checks], partition_key="0000-0511", resources=_resources(two), instance=instance)
    evaluations = first.get_asset_check_evaluations()
    assert sorted(e.check_name for e in evaluations) == sorted(c.check_key.name for c in checks)
    assert all(e.passed and e.metadata["scope"].value == "slices 0000-0511" for e in evaluations)
    assert all(e.metadata["engine"].value == "local" for e in evaluations), "a range's checks start no JVM"
    reconcile = next(e for e in evaluations if e.check_name == "events_reconcile_with_source")
    lower = tables.read(spark, str(warehouse / "events")).where("slice <= 511").count()
    assert reconcile.metadata["lake_events"].value == lower > 0

    # A row of the other range duplicated: that range's check and the table-wide one see it, this range's not.
    events_path = str(warehouse / "events")
    dg.materialize([events], partition_key="0512-1023", resources=_resources(two), instance=instance)
    tables.read(spark, events_path).where("slice >= 512").limit(1).write.format("delta").mode("append").save(events_path)
    again = dg.materialize([events, *checks], partition_key="0000-0511", resources=_resources(two), instance=instance)
    assert all(e.passed for e in again.get_asset_check_evaluations())
    other = dg.materialize([events, *checks], partition_key="0512-1023", resources=_resources(two), instance=instance,
                           raise_on_error=False)
    failed = {e.check_name for e in other.get_asset_check_evaluations() if not e.passed}
    assert failed == {"events_no_duplicates", "events_reconcile_with_source"}
    assert not _run(events_checks.events_no_duplicates, _resources(two)).passed, "table-wide, it is seen too"


def test_reconcile_holds_while_runs_commit_between_its_reads(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path
) -> None:
    """Runs that commit while the check reads (after its first look at the store, and after it fixes the lake's
    version) are no failure; a row above the watermarks outside any batch still is."""
    store = EventStore(dsn.writer)
    run_workload(store, streams=30, events=200, writers=2, rollback_rate=0, max_commit_delay=0)
    extractor = Extractor(settings.pg_dsn, spark, warehouse)
    extractor.run(SliceRange(0, 1023))
    moved: list[int] = []

    def runs_commit(moment: str) -> None:
        run_workload(store, streams=30, events=50, writers=1, rollback_rate=0, max_commit_delay=0)
        moved.append(extractor.run(SliceRange(0, 1023)).rows)

    result = events_checks.reconcile(Engine(spark=spark), warehouse, settings.pg_dsn, "es", None, between=runs_commit)
    assert result.metadata["engine"].value == "local"
    assert moved == [50, 50] and result.passed, result.metadata
    assert result.metadata["lake_events"].value == 200, "counted below the watermarks of its first look"

    events = str(warehouse / "events")
    stray = tables.read(spark, events).orderBy("tx_id", ascending=False).limit(1).selectExpr(
        *[c if c != "tx_id" else "tx_id + 1000000 AS tx_id" for c in tables.read(spark, events).columns])
    stray.write.format("delta").mode("append").save(events)
    broken = events_checks.reconcile(Engine(spark=spark), warehouse, settings.pg_dsn, "es", None)
    assert not broken.passed and broken.metadata["above_watermark"].value == 1


def test_stream_state_is_checked_against_the_events_it_has_folded(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events extracted after the last update wait for the next one: no failure; a state behind what it
    folded is one, by Arrow's check and by Spark's, and no snapshot of it is written back."""
    store = EventStore(dsn.writer)
    run_workload(store, streams=20, events=100, writers=1, rollback_rate=0, max_commit_delay=0)
    extractor = Extractor(settings.pg_dsn, spark, warehouse)
    extractor.run(SliceRange(0, 1023))
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    run_workload(store, streams=20, events=100, writers=1, rollback_rate=0, max_commit_delay=0)
    assert extractor.run(SliceRange(0, 1023)).rows == 100
    r = _resources(settings)
    result = _run(projections_checks.stream_state_version_matches_events, r)
    assert result.passed, result.metadata
    assert result.metadata["read_with"].value == "arrow"  # no JVM for the check the snapshots wait on
    spark.sql(f"UPDATE delta.`{warehouse / 'stream_state'}` SET version = version - 1")
    assert not _run(projections_checks.stream_state_version_matches_events, r).passed

    # Spark's check agrees (past the engine rule's bound, or over deletion vectors, it is the one that runs).
    by_spark = _run(projections_checks.stream_state_version_matches_events, _resources(settings, "spark"))
    assert not by_spark.passed and by_spark.metadata["engine"].value == "spark"

    # It gates the snapshots' write-back: with the state off, `snapshots_job` writes nothing into the store.
    job = build_definitions(replace(settings, spark_master="local[2]"), SHOP).resolve_job_def("snapshots_job")
    result = job.execute_in_process(instance=dg.DagsterInstance.ephemeral(), raise_on_error=False)
    assert not result.success
    assert "snapshots" not in {e.step_key for e in result.get_step_success_events()}
    assert EventStore(dsn).snapshot_keys() == []


@pytest.mark.slow  # three workloads, four projections, each check twice (make check's 3-minute budget)
def test_projection_checks_compare_like_with_like_and_fail_on_a_wrong_row(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each projection against `events` at the version it folded: events extracted since (not folded yet) and
    events waiting for a lower batch fail nothing; a row that is not what `events` gives fails its check."""
    store = EventStore(dsn.writer)
    run_workload(store, streams=40, events=400, writers=2, rollback_rate=0, max_commit_delay=0, seed=5)
    extractor = Extractor(settings.pg_dsn, None, warehouse)
    extractor.run(SliceRange(0, 1023))
    update_stream_catalog(Engine(spark=spark), warehouse)
    update_event_type_daily(Engine(spark=spark), warehouse)
    # A frontier below the last batch: its rows wait in `events`, and the check leaves them out as the fold did.
    last_batch = int(tables.read(spark, str(warehouse / "events")).agg({"batch_id": "max"}).first()[0])
    cross_stream.update(warehouse, SHOP, "sku_sales", frontier=lambda: last_batch + 1)
    run_workload(store, streams=40, events=100, writers=2, rollback_rate=0, max_commit_delay=0, seed=6)
    extractor.run(SliceRange(0, 1023))
    waiting = cross_stream.update(warehouse, SHOP, "sku_sales", frontier=lambda: last_batch + 1)
    assert waiting.figures["events_waiting"] > 0
    run_workload(store, streams=40, events=100, writers=2, rollback_rate=0, max_commit_delay=0, seed=7)
    extractor.run(SliceRange(0, 1023))  # extracted, folded by none of them yet: not a failure

    r = _resources(settings)
    checks = [projections_checks.stream_catalog_matches_events, projections_checks.event_type_daily_matches_events,
              *projections_checks.build_projection_checks(SHOP)]
    for check in checks:
        result = _run(check, r)
        assert result.passed, (check.check_key.name, result.metadata)
        assert result.metadata["events_version_folded"].value >= 0
    # The aggregates' Spark path (past the engine rule's bound); in process in bounded pieces (four spans).
    assert all(_run(check, _resources(settings, "spark")).passed for check in checks[:2])
    with monkeypatch.context() as m:
        m.setattr(pieces, "PIECE_BYTES", tables.files_bytes(DeltaTable(str(warehouse / "events"))) // 4 + 1)
        assert all(_run(check, r).passed for check in checks[:2])

    # The expected counts, from the store: the checks above agreed with `events`, which equals the store.
    cross_stream.update(warehouse, SHOP, "sku_sales")
    with psycopg.connect(dsn) as conn:
        units = dict(conn.execute("SELECT payload->>'sku', count(*) FROM es.events WHERE event_type IN "
                                  "('ItemAdded', 'ItemRemoved') AND payload ? 'sku' GROUP BY 1").fetchall())
    folded = {row["sku"]: row["events"] for row in tables.read(spark, str(warehouse / "sku_sales")).collect()}
    assert folded == units

    sku = min(folded)
    stream = tables.read(spark, str(warehouse / "stream_catalog")).agg({"stream_id": "min"}).first()[0]
    spark.sql(f"UPDATE delta.`{warehouse / 'stream_catalog'}` SET events = events + 1 WHERE stream_id = '{stream}'")
    spark.sql(f"DELETE FROM delta.`{warehouse / 'event_type_daily'}` WHERE event_type = 'ItemAdded'")
    spark.sql(f"UPDATE delta.`{warehouse / 'sku_sales'}` SET events = events - 1 WHERE sku = '{sku}'")
    for check in checks:
        result = _run(check, r)
        assert not result.passed, check.check_key.name
        assert result.metadata["keys_off"].value >= 1
    assert not any(_run(check, _resources(settings, "spark")).passed for check in checks[:2])
    monkeypatch.setattr(pieces, "PIECE_BYTES", tables.files_bytes(DeltaTable(str(warehouse / "events"))) // 4 + 1)
    assert not any(_run(check, r).passed for check in checks[:2])
