"""Every projection of the shop updated as their assets run it, and each compared with a fold of the store: the
expected values come from the store (SQL and the domain's reducers over `es.events`), never from the lake."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.domain import Event
from es_pipeline.extraction.offsets import batch_frontier
from es_pipeline.lake import cross_stream
from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.lake.typed import event_tables
from es_pipeline.source import mapping
from es_pipeline_tests.support.roles import StoreDsn


def update_every_projection(spark: Any, warehouse: Path, dsn: StoreDsn) -> None:
    """Every projection's update, as their assets run it (Spark where a whole build needs it)."""
    consumer = mapping.load(None, "es").consumer
    update_stream_catalog(Engine(spark=spark), warehouse, store_dsn=dsn.extractor)
    update_event_type_daily(Engine(spark=spark), warehouse, store_dsn=dsn.extractor)
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP, store_dsn=dsn.extractor)
    cross_stream.update(warehouse, SHOP, "sku_sales", store_dsn=dsn.extractor,
                        frontier=lambda: batch_frontier(dsn.extractor, consumer))
    event_tables.update(warehouse, SHOP, store_dsn=dsn.extractor)


def rows_of(warehouse: Path, name: str) -> list[dict[str, Any]]:
    return DeltaTable(str(warehouse / name)).to_pyarrow_table().to_pylist()


def assert_every_projection_equals_the_store(warehouse: Path, dsn: StoreDsn) -> int:
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

    assert {r["stream_id"]: (r["events"], r["version"]) for r in rows_of(warehouse, "stream_catalog")} == catalog
    assert {(r["stream_type"], r["event_type"], r["event_date"]): r["events"]
            for r in rows_of(warehouse, "event_type_daily")} == daily
    assert {r["sku"]: (r["events"], r["units_added"], r["removals"]) for r in rows_of(warehouse, "sku_sales")} == sales
    assert {r["stream_id"]: (r["version"], json.loads(r["state"])) for r in rows_of(warehouse, "stream_state")} == states
    typed = {r["event_type"]: r["table_name"] for r in rows_of(warehouse, event_tables.NAME)}
    assert {t: DeltaTable(str(warehouse / typed[t])).to_pyarrow_table().num_rows for t in typed} == dict(by_type)
    return sum(by_type.values())
