"""Analysts: every table registered by name in Spark SQL, time travel, and readable by delta-rs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.dev.workload import run_workload
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog
from es_pipeline.lake.delta import tables
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.read.catalog import register_tables
from es_pipeline.lake.state.snapshots import take_snapshots
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.roles import StoreDsn


def test_every_table_is_queryable_by_name_with_time_travel_and_readable_by_delta_rs(
    dsn: StoreDsn, spark: Any, warehouse: Path
) -> None:
    store = EventStore(dsn)
    run_workload(store, streams=30, events=300, writers=2, rollback_rate=0, max_commit_delay=0)
    ex = Extractor(dsn.extractor, spark, warehouse)
    ex.run(SliceRange(0, 1023))
    run_workload(store, streams=10, events=100, writers=1, rollback_rate=0, max_commit_delay=0)
    ex.run(SliceRange(0, 1023))
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    update_stream_catalog(Engine(spark=spark), warehouse)
    update_event_type_daily(Engine(spark=spark), warehouse)
    take_snapshots(Engine(spark=spark), warehouse, store, threshold=5)

    names = register_tables(spark, warehouse)
    assert sorted(names) == sorted([*tables.TABLES, "stream_state_account", "stream_state_cart",  # typed: the shop's
                                    "stream_state_account_history", "stream_state_cart_history"])  # and its history
    open_carts = spark.sql("SELECT count(*) AS n FROM stream_state_cart WHERE status = 'open'").first()["n"]
    assert open_carts == spark.sql("SELECT count(*) AS n FROM stream_state WHERE stream_type = 'cart' "
                                   "AND get_json_object(state, '$.status') = 'open'").first()["n"]
    assert spark.sql("SELECT count(*) AS n FROM events").first()["n"] == 400
    # Version 0 is the empty table, 1 its binding to the store (es_pipeline.source), 2 the first batch: time
    # travel sees the first 300 only.
    assert spark.sql("SELECT count(*) AS n FROM events VERSION AS OF 1").first()["n"] == 0
    assert spark.sql("SELECT count(*) AS n FROM events VERSION AS OF 2").first()["n"] == 300
    daily = spark.sql("SELECT sum(events) AS n FROM event_type_daily").first()["n"]
    assert daily == 400
    for name in names:
        table = DeltaTable(tables.table_path(warehouse, name)).to_pyarrow_table()
        assert table.num_rows > 0, name
    assert DeltaTable(tables.table_path(warehouse, "events")).to_pyarrow_table().num_rows == 400
