"""The library's checks of the lake (es_pipeline/checks/), on both engines, against good lakes and broken ones; and
`es-pipeline lake check`, which runs them without Dagster. Dagster's wrapping: es_pipeline_tests/defs/test_checks.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline import checks
from es_pipeline.checks.events import reconcile
from es_pipeline.cli import main
from es_pipeline.dev.workload import run_workload
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.lake import cross_stream
from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog
from es_pipeline.lake.delta import pieces, tables
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.settings import Settings
from es_pipeline.source.mapping import native
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.roles import StoreDsn

EVERY = {c.name: c for c in checks.every_check(SHOP)}


def _given(settings: Settings, spark: Any, engine: str = "auto") -> checks.Given:
    return checks.Given(Engine(engine, spark), settings.warehouse, settings.pg_dsn, native("es"))


def _run(name: str, given: checks.Given) -> checks.Outcome:
    return EVERY[name].run(given)


@pytest.mark.parametrize("engine", ["auto", "pieces", "spark"])
def test_checks_pass_on_a_good_lake_and_fail_on_broken_ones(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path, engine: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """On either engine: `auto` checks a small lake in this process (DataFusion, Arrow), `pieces` the same in five
    spans of slices (lake/delta/pieces.py, as a lake past a piece's bytes is), `spark` on Spark."""
    run_workload(EventStore(dsn.writer), streams=40, events=300, writers=2, rollback_rate=0, max_commit_delay=0)
    Extractor(settings.pg_dsn, spark, warehouse).run(SliceRange(0, 1023))
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    if engine == "pieces":
        monkeypatch.setattr(pieces, "PIECE_BYTES", tables.files_bytes(DeltaTable(str(warehouse / "events"))) // 5 + 1)
        engine = "auto"
    given = _given(settings, spark, engine)
    in_process_only = {f"{name}_matches_events" for name in SHOP.projections}  # cross-stream: no Spark path
    found = checks.run(list(EVERY.values()), given)
    for name, outcome in found.items():
        assert isinstance(outcome, checks.Outcome) and outcome.passed, (name, outcome)
        if "engine" in outcome.metadata:
            spark_expected = engine == "spark" and name not in in_process_only
            assert outcome.metadata["engine"] == ("spark" if spark_expected else "local"), name

    events = str(warehouse / "events")
    df = tables.read(spark, events)
    victim = df.where("version = 1").orderBy("stream_id").first()
    # A duplicate row: the duplicate check fails; reconcile fails too (one more than the source).
    df.where(f"stream_id = '{victim['stream_id']}' AND version = 1").write.format("delta").mode("append").save(events)
    assert not _run("events_no_duplicates", given).passed
    assert not _run("events_reconcile_with_source", given).passed
    # A lost row below the watermark: contiguity and reconcile fail.
    spark.sql(f"DELETE FROM delta.`{events}` WHERE stream_id = '{victim['stream_id']}' AND version = 1")
    assert _run("events_no_duplicates", given).passed
    assert not _run("events_versions_contiguous", given).passed
    assert not _run("events_reconcile_with_source", given).passed
    # A stream_state row behind its events.
    spark.sql(f"UPDATE delta.`{warehouse / 'stream_state'}` SET version = version - 1 WHERE stream_id = '{victim['stream_id']}'")
    assert not _run("stream_state_version_matches_events", given).passed

    if engine == "auto":  # the command line runs the same checks, one line each, without Dagster
        monkeypatch.setenv("ES_PIPELINE_PG_DSN", settings.pg_dsn)
        monkeypatch.setenv("ES_PIPELINE_WAREHOUSE", str(warehouse))
        monkeypatch.setenv("ES_PIPELINE_DOMAIN", "shop.domain")
        capsys.readouterr()
        assert main(["lake", "check", "events", "stream_catalog"]) == 1
        lines = capsys.readouterr().out.splitlines()
        assert [line.split()[:2] for line in lines[1:-1]] == [
            ["PASS", "events_no_duplicates"], ["FAIL", "events_versions_contiguous"],
            ["FAIL", "events_reconcile_with_source"], ["PASS", "stream_catalog_matches_events"]]
        assert lines[-1] == "2 passed, 2 failed: events_versions_contiguous, events_reconcile_with_source"
        assert "missing_below_watermark 1" in lines[2] and "engine local" in lines[2]
        assert main(["lake", "check", "sku_sales"]) == 0
        assert main(["lake", "check", "nonesuch"]) == 2
        assert "no check of nonesuch: the tables checked are events, stream_state" in capsys.readouterr().err


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

    result = reconcile(Engine(spark=spark), warehouse, settings.pg_dsn, "es", None, between=runs_commit)
    assert result.metadata["engine"] == "local"
    assert moved == [50, 50] and result.passed, result.metadata
    assert result.metadata["lake_events"] == 200, "counted below the watermarks of its first look"

    events = str(warehouse / "events")
    stray = tables.read(spark, events).orderBy("tx_id", ascending=False).limit(1).selectExpr(
        *[c if c != "tx_id" else "tx_id + 1000000 AS tx_id" for c in tables.read(spark, events).columns])
    stray.write.format("delta").mode("append").save(events)
    broken = reconcile(Engine(spark=spark), warehouse, settings.pg_dsn, "es", None)
    assert not broken.passed and broken.metadata["above_watermark"] == 1


def test_stream_state_is_checked_against_the_events_it_has_folded(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path
) -> None:
    """Events extracted after the last update wait for the next one: no failure; a state behind what it folded is
    one, by Arrow's check and by Spark's."""
    store = EventStore(dsn.writer)
    run_workload(store, streams=20, events=100, writers=1, rollback_rate=0, max_commit_delay=0)
    extractor = Extractor(settings.pg_dsn, spark, warehouse)
    extractor.run(SliceRange(0, 1023))
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    run_workload(store, streams=20, events=100, writers=1, rollback_rate=0, max_commit_delay=0)
    assert extractor.run(SliceRange(0, 1023)).rows == 100
    result = _run("stream_state_version_matches_events", _given(settings, spark))
    assert result.passed, result.metadata
    assert result.metadata["read_with"] == "arrow"  # no JVM for the check the snapshots wait on
    spark.sql(f"UPDATE delta.`{warehouse / 'stream_state'}` SET version = version - 1")
    assert not _run("stream_state_version_matches_events", _given(settings, spark)).passed

    # Spark's check agrees (past the engine rule's bound, or over deletion vectors, it is the one that runs).
    by_spark = _run("stream_state_version_matches_events", _given(settings, spark, "spark"))
    assert not by_spark.passed and by_spark.metadata["engine"] == "spark"


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

    given, on_spark = _given(settings, spark), _given(settings, spark, "spark")
    names = ["stream_catalog_matches_events", "event_type_daily_matches_events", "sku_sales_matches_events"]
    for name in names:
        result = _run(name, given)
        assert result.passed, (name, result.metadata)
        assert result.metadata["events_version_folded"] >= 0
    # The aggregates' Spark path (past the engine rule's bound); in process in bounded pieces (four spans).
    assert all(_run(name, on_spark).passed for name in names[:2])
    with monkeypatch.context() as m:
        m.setattr(pieces, "PIECE_BYTES", tables.files_bytes(DeltaTable(str(warehouse / "events"))) // 4 + 1)
        assert all(_run(name, given).passed for name in names[:2])

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
    for name in names:
        result = _run(name, given)
        assert not result.passed, name
        assert result.metadata["keys_off"] >= 1
    assert not any(_run(name, on_spark).passed for name in names[:2])
    monkeypatch.setattr(pieces, "PIECE_BYTES", tables.files_bytes(DeltaTable(str(warehouse / "events"))) // 4 + 1)
    assert not any(_run(name, given).passed for name in names[:2])
