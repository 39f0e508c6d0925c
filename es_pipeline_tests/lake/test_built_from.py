"""Every projection knows which `events` table it was built from: the lake rebuilt as the refusals and
docs/operations.md say (the `events` folder removed, `offsets reset`, extracted again), in more commits or in
fewer, leaves every projection equal to a fold of the store, never read on from its position in the old table.

The expected values come from the store (SQL and the domain's reducers over `es.events`), never from the lake."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.cli import main
from es_pipeline.dev.workload import run_workload
from es_pipeline.domain import Event
from es_pipeline.extraction.offsets import batch_frontier
from es_pipeline.lake import cross_stream, event_tables
from es_pipeline.lake.behind import Lake
from es_pipeline.lake.projections import update_event_type_daily, update_stream_catalog
from es_pipeline.lake.stream_state import update_stream_state
from es_pipeline.source import mapping
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.lakecheck import assert_exactly_once_by_key, extract_all
from es_pipeline_tests.support.roles import StoreDsn

PROJECTIONS = ("stream_state", "stream_catalog", "event_type_daily", "sku_sales", event_tables.NAME)


def _update_all(spark: Any, warehouse: Path, dsn: StoreDsn) -> None:
    """Every projection's update, as their assets run it (Spark where a whole build needs it)."""
    consumer = mapping.load(None, "es").consumer
    update_stream_catalog(spark, warehouse, store_dsn=dsn.extractor)
    update_event_type_daily(spark, warehouse, store_dsn=dsn.extractor)
    update_stream_state(spark, warehouse, domain=SHOP, store_dsn=dsn.extractor)
    cross_stream.update(warehouse, SHOP, "sku_sales", store_dsn=dsn.extractor,
                        frontier=lambda: batch_frontier(dsn.extractor, consumer))
    event_tables.update(warehouse, SHOP, store_dsn=dsn.extractor)


def _rows(warehouse: Path, name: str) -> list[dict[str, Any]]:
    return DeltaTable(str(warehouse / name)).to_pyarrow_table().to_pylist()


def _assert_every_projection_equals_the_store(warehouse: Path, dsn: StoreDsn) -> int:
    with psycopg.connect(dsn) as conn:
        catalog = {r[0]: (r[1], r[2]) for r in conn.execute(
            "SELECT stream_id, count(*), max(version) FROM es.events GROUP BY stream_id")}
        daily = {(r[0], r[1], r[2]): r[3] for r in conn.execute(
            "SELECT stream_type, event_type, (recorded_at AT TIME ZONE 'UTC')::date, count(*) FROM es.events "
            "GROUP BY 1, 2, 3")}
        sales = {r[0]: (r[1], r[2], r[3]) for r in conn.execute(
            "SELECT payload->>'sku', count(*), "
            "sum(CASE WHEN event_type = 'ItemAdded' THEN coalesce((payload->>'qty')::int, 1) ELSE 0 END), "
            "count(*) FILTER (WHERE event_type = 'ItemRemoved') "
            "FROM es.events WHERE event_type IN ('ItemAdded', 'ItemRemoved') AND payload ? 'sku' GROUP BY 1")}
        history = conn.execute("SELECT stream_id, stream_type, version, event_type, payload FROM es.events "
                               "ORDER BY stream_id, version").fetchall()
        by_type = Counter(r[0] for r in conn.execute("SELECT event_type FROM es.events"))
    states: dict[str, tuple[int, dict[str, Any]]] = {}
    for stream_id, stream_type, version, event_type, payload in history:
        state = states.get(stream_id, (0, {}))[1]
        states[stream_id] = (version, SHOP.reducers[stream_type].fold(state, Event(stream_id, version, event_type, payload)))

    assert {r["stream_id"]: (r["events"], r["version"]) for r in _rows(warehouse, "stream_catalog")} == catalog
    assert {(r["stream_type"], r["event_type"], r["event_date"]): r["events"]
            for r in _rows(warehouse, "event_type_daily")} == daily
    assert {r["sku"]: (r["events"], r["units_added"], r["removals"]) for r in _rows(warehouse, "sku_sales")} == sales
    assert {r["stream_id"]: (r["version"], json.loads(r["state"])) for r in _rows(warehouse, "stream_state")} == states
    typed = {r["event_type"]: r["table_name"] for r in _rows(warehouse, event_tables.NAME)}
    assert {t: DeltaTable(str(warehouse / typed[t])).to_pyarrow_table().num_rows for t in typed} == dict(by_type)
    return sum(by_type.values())


def _rebuild_events(warehouse: Path, dsn: StoreDsn, n_ranges: int) -> None:
    """The lake's `events` rebuilt the way the refusals say: the folder removed, `offsets reset`, extracted again
    (one commit per range: more or fewer commits than the table before)."""
    shutil.rmtree(warehouse / "events")
    assert main(["offsets", "reset"]) == 0
    extract_all(dsn.extractor, None, warehouse, n_ranges=n_ranges)


@pytest.mark.slow
def test_the_lake_rebuilt_in_more_then_fewer_commits_leaves_every_projection_equal_to_the_store(
    dsn: StoreDsn, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ES_PIPELINE_PG_DSN", dsn.extractor)
    monkeypatch.setenv("ES_PIPELINE_WAREHOUSE", str(warehouse))
    store = EventStore(dsn.writer)
    run_workload(store, streams=80, events=1500, writers=3, rollback_rate=0.1, max_commit_delay=0, seed=71)
    extract_all(dsn.extractor, None, warehouse, n_ranges=1)
    _update_all(spark, warehouse, dsn)
    assert _assert_every_projection_equals_the_store(warehouse, dsn) > 0

    # More commits than before: read on from the old position, the new table's later commits were counted again.
    _rebuild_events(warehouse, dsn, n_ranges=8)
    folded = Lake(warehouse).folded()
    assert all(folded[name] is None for name in PROJECTIONS), folded  # rebuilding, never "up to date"
    _update_all(spark, warehouse, dsn)
    assert_exactly_once_by_key(warehouse, dsn)
    _assert_every_projection_equals_the_store(warehouse, dsn)
    assert all(v is not None and v == Lake(warehouse).events_version() for v in Lake(warehouse).folded().values())

    # Fewer commits than before, with events the old table never had: read as "nothing new", they were frozen.
    run_workload(store, streams=80, events=400, writers=2, rollback_rate=0, max_commit_delay=0, seed=72)
    _rebuild_events(warehouse, dsn, n_ranges=1)
    _update_all(spark, warehouse, dsn)
    _assert_every_projection_equals_the_store(warehouse, dsn)

    # And on from the rebuild: an ordinary increment.
    run_workload(store, streams=80, events=200, writers=2, rollback_rate=0, max_commit_delay=0, seed=73)
    extract_all(dsn.extractor, None, warehouse, n_ranges=2)
    _update_all(spark, warehouse, dsn)
    _assert_every_projection_equals_the_store(warehouse, dsn)
