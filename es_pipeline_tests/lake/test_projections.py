"""`stream_catalog` and `event_type_daily`: kept incrementally, equal to the source at every step."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.dev.workload import run_workload
from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog
from es_pipeline.lake.delta import pieces, tables
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.lakecheck import extract_all
from es_pipeline_tests.support.roles import StoreDsn


def source_catalog(dsn: StoreDsn) -> dict[str, tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT stream_id, min(stream_type), min(recorded_at), max(recorded_at), max(version), count(*) "
            "FROM es.events GROUP BY stream_id"
        ).fetchall()
    return {r[0]: (r[1], r[2], r[3], r[4], r[5]) for r in rows}


def lake_catalog(spark: Any, warehouse: Path) -> dict[str, tuple[Any, ...]]:
    rows = tables.read(spark, str(warehouse / "stream_catalog")).collect()
    return {
        r["stream_id"]: (r["stream_type"], r["first_event_at"], r["last_event_at"], r["version"], r["events"])
        for r in rows
    }


def source_daily(dsn: StoreDsn) -> dict[tuple[str, str, Any], int]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT stream_type, event_type, (recorded_at AT TIME ZONE 'UTC')::date, count(*) FROM es.events GROUP BY 1, 2, 3"
        ).fetchall()
    return {(r[0], r[1], r[2]): r[3] for r in rows}


def lake_daily(spark: Any, warehouse: Path) -> dict[tuple[str, str, Any], int]:
    rows = tables.read(spark, str(warehouse / "event_type_daily")).collect()
    return {(r["stream_type"], r["event_type"], r["event_date"]): r["events"] for r in rows}


def same_instants(a: dict[str, tuple[Any, ...]], b: dict[str, tuple[Any, ...]]) -> None:
    """Spark returns naive local timestamps, Postgres aware ones: compare as instants."""
    assert a.keys() == b.keys()
    for k in a:
        ta, tb = a[k], b[k]
        assert ta[0] == tb[0] and ta[3:] == tb[3:], k
        for x, y in zip(ta[1:3], tb[1:3], strict=True):
            assert x.timestamp() == y.timestamp(), k


def test_incremental_catalog_and_daily_counts_equal_the_source_with_concurrent_writers(
    dsn: StoreDsn, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_workload(EventStore(dsn), streams=20, events=100, writers=2, rollback_rate=0, max_commit_delay=0, seed=20)
    extract_all(dsn.extractor, spark, warehouse)
    # The in-process first builds in bounded pieces (lake/delta/pieces.py): the catalog in four pieces by slice
    # span, the daily counts 30 rows at a time, each step combined with those before.
    monkeypatch.setattr(pieces, "BATCH_ROWS", 7)
    monkeypatch.setattr(pieces, "CHUNK_ROWS", 30)
    monkeypatch.setattr(pieces, "PIECE_BYTES", tables.files_bytes(DeltaTable(str(warehouse / "events"))) // 4 + 1)
    first = update_stream_catalog(Engine(spark=spark), warehouse)
    assert first.previous_events_version == -1 and first.events_folded == 100
    assert first.engine == "local", "a small lake's first build starts no JVM (the engine rule)"
    assert update_event_type_daily(Engine(spark=spark), warehouse).engine == "local"
    by_arrow = lake_catalog(spark, warehouse), lake_daily(spark, warehouse)
    for name in ("stream_catalog", "event_type_daily"):
        shutil.rmtree(warehouse / name)
    assert update_stream_catalog(Engine(spark=spark, small_increments=False), warehouse).engine == "spark"
    assert update_event_type_daily(Engine(spark=spark, small_increments=False), warehouse).engine == "spark"
    assert (lake_catalog(spark, warehouse), lake_daily(spark, warehouse)) == by_arrow, "either engine, one table"
    # 10 s of writers at 80 events/s (their rate, not the size, sets the time): several increments under them.
    writers = threading.Thread(target=run_workload, args=(EventStore(dsn),), kwargs=dict(
        streams=150, events=800, writers=8, rollback_rate=0.1, max_commit_delay=0.1, seed=21, rate=80.0))
    writers.start()
    increments = 0
    while writers.is_alive():
        extract_all(dsn.extractor, spark, warehouse)
        catalog = update_stream_catalog(Engine(spark=spark), warehouse)
        daily = update_event_type_daily(Engine(spark=spark), warehouse)
        increments += 1
    writers.join()
    extract_all(dsn.extractor, spark, warehouse)
    catalog = update_stream_catalog(Engine(spark=spark), warehouse)
    daily = update_event_type_daily(Engine(spark=spark), warehouse)
    assert increments >= 2
    assert catalog.previous_events_version >= 0 and daily.previous_events_version >= 0, "merged, not rebuilt"
    assert catalog.events_folded < 2100, "only the increment was read"
    same_instants(lake_catalog(spark, warehouse), source_catalog(dsn))
    assert lake_daily(spark, warehouse) == source_daily(dsn)


def test_a_repeated_update_counts_nothing_twice(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    run_workload(EventStore(dsn), streams=30, events=200, writers=2, rollback_rate=0, max_commit_delay=0, seed=22)
    extract_all(dsn.extractor, spark, warehouse)
    update_stream_catalog(Engine(spark=spark), warehouse)
    update_event_type_daily(Engine(spark=spark), warehouse)
    run_workload(EventStore(dsn), streams=30, events=100, writers=2, rollback_rate=0, max_commit_delay=0, seed=23)
    extract_all(dsn.extractor, spark, warehouse)
    assert update_event_type_daily(Engine(spark=spark), warehouse).events_folded == 100
    again = update_event_type_daily(Engine(spark=spark), warehouse)
    assert again.events_folded == 0 and again.figures.get("keys_updated", 0) == 0
    assert again.rows == len(lake_daily(spark, warehouse)), "an update with nothing new still reports the table's rows"
    assert update_stream_catalog(Engine(spark=spark), warehouse).events_folded == 100
    assert sum(lake_daily(spark, warehouse).values()) == 300
    assert sum(v[4] for v in lake_catalog(spark, warehouse).values()) == 300


def test_overlapping_updates_count_nothing_twice(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    """Automation and a manual materialization at once: with the store's lock, one waits for the other."""
    store = EventStore(dsn)
    run_workload(store, streams=30, events=200, writers=2, rollback_rate=0, max_commit_delay=0, seed=1)
    extract_all(dsn.extractor, spark, warehouse)
    update_event_type_daily(Engine(spark=spark), warehouse, store_dsn=dsn.extractor)
    for seed in (2, 3):
        run_workload(store, streams=30, events=150, writers=2, rollback_rate=0, max_commit_delay=0, seed=seed)
        extract_all(dsn.extractor, spark, warehouse)
        errors: list[BaseException] = []

        def update(errors: list[BaseException] = errors) -> None:
            try:
                update_event_type_daily(Engine(spark=spark), warehouse, store_dsn=dsn.extractor)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        both = [threading.Thread(target=update) for _ in range(2)]
        for t in both:
            t.start()
        for t in both:
            t.join()
        assert not errors, errors
        assert lake_daily(spark, warehouse) == source_daily(dsn)


def test_a_change_feed_vacuumed_away_is_rebuilt_not_failed(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    store = EventStore(dsn)
    run_workload(store, streams=30, events=200, writers=2, rollback_rate=0, max_commit_delay=0, seed=1)
    extract_all(dsn.extractor, spark, warehouse)
    update_stream_catalog(Engine(spark=spark), warehouse)
    update_event_type_daily(Engine(spark=spark), warehouse)
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    for seed in (2, 3):  # commits the projections have not read yet
        run_workload(store, streams=30, events=100, writers=2, rollback_rate=0, max_commit_delay=0, seed=seed)
        extract_all(dsn.extractor, spark, warehouse)
    events = str(warehouse / "events")
    spark.sql(f"OPTIMIZE delta.`{events}`")
    spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
    try:
        spark.sql(f"VACUUM delta.`{events}` RETAIN 0 HOURS")  # the files those commits added are gone
    finally:
        spark.conf.unset("spark.databricks.delta.retentionDurationCheck.enabled")
    catalog = update_stream_catalog(Engine(spark=spark), warehouse)
    daily = update_event_type_daily(Engine(spark=spark), warehouse)
    assert catalog.previous_events_version == -1 and daily.previous_events_version == -1, "rebuilt whole"
    same_instants(lake_catalog(spark, warehouse), source_catalog(dsn))
    assert lake_daily(spark, warehouse) == source_daily(dsn)
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)  # folds every event again; the fold skips what each state has
    state = {r["stream_id"]: r["version"] for r in tables.read(spark, str(warehouse / "stream_state")).collect()}
    assert state == {k: v[3] for k, v in source_catalog(dsn).items()}
