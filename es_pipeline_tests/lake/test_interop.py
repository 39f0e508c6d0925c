"""Every table es_pipeline writes, read by Spark, delta-rs, DuckDB's delta reader and Polars: the same counts and
sums from each, on a fresh lake, after compaction, after a tenant's erasure, and on S3."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import polars as pl
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.dev.s3proxy import S3Server
from es_pipeline.dev.workload import run_workload
from es_pipeline.extraction.erase import erase_tenant
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.offsets import batch_frontier
from es_pipeline.extraction.slices import split
from es_pipeline.lake import cross_stream, inventory
from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog
from es_pipeline.lake.delta import tables
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.maintenance import maintain
from es_pipeline.lake.read import query
from es_pipeline.lake.state import history, stream_state
from es_pipeline.lake.state.snapshots import take_snapshots
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.lake.typed import event_tables
from es_pipeline.settings import Settings
from es_pipeline.source.mapping import load
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.lakecheck import extract_all
from es_pipeline_tests.support.roles import StoreDsn

SOURCE = load("es-tenants")
TENANTS = ("acme", "globex")
GONE = "globex"
_NUMBERS = (pa.types.is_integer, pa.types.is_floating)


def _figures_by_delta_rs(path: str) -> tuple[list[str], dict[str, Any]]:
    """The table's numeric columns, and count and sums read by delta-rs (the reference the others must match)."""
    table = DeltaTable(path).to_pyarrow_table()
    numeric = [f.name for f in table.schema if any(k(f.type) for k in _NUMBERS)]
    sums = {c: pc.sum(table[c].cast(pa.float64())).as_py() or 0.0 for c in numeric}
    return numeric, {"count": table.num_rows, **sums}


def _by_spark(spark: Any, path: str, numeric: list[str]) -> dict[str, Any]:
    frame = spark.read.format("delta").load(path)
    row = frame.selectExpr("count(*) AS count", *(f"coalesce(sum(CAST(`{c}` AS DOUBLE)), 0) AS `{c}`"
                                                   for c in numeric)).first()
    return {"count": row["count"], **{c: row[c] for c in numeric}}


def _by_duckdb(con: Any, name: str, numeric: list[str]) -> dict[str, Any]:
    sums = [f'coalesce(sum(CAST("{c}" AS DOUBLE)), 0)' for c in numeric]
    row = con.execute(f'SELECT {", ".join(["count(*)", *sums])} FROM "{name}"').fetchone()
    return {"count": row[0], **dict(zip(numeric, row[1:], strict=False))}


def _by_polars(path: str, numeric: list[str]) -> dict[str, Any]:
    frame = pl.scan_delta(path).select(pl.len().alias("count"),
                                       *(pl.col(c).cast(pl.Float64).sum().alias(c) for c in numeric)).collect()
    return frame.to_dicts()[0]


def assert_every_engine_agrees(spark: Any, warehouse: Any, *, expect: set[str]) -> dict[str, dict[str, Any]]:
    """For each table of the lake (which must include `expect`): count and numeric sums equal from the four readers."""
    names = [n for n in inventory.lake_tables(warehouse) if tables.is_delta_table(tables.table_path(warehouse, n))]
    assert expect <= set(names), expect - set(names)
    con, registered = query.duckdb_connection(warehouse)
    assert set(registered) == set(names)
    figures = {}
    for name in names:
        path = tables.table_path(warehouse, name)
        numeric, reference = _figures_by_delta_rs(path)
        for engine, got in (("spark", _by_spark(spark, path, numeric)), ("duckdb", _by_duckdb(con, name, numeric)),
                            ("polars", _by_polars(path, numeric))):
            assert got["count"] == reference["count"], (name, engine, got, reference)
            for c in numeric:
                assert math.isclose(float(got[c] or 0), float(reference[c]), rel_tol=1e-9, abs_tol=1e-6), \
                    (name, engine, c, got[c], reference[c])
        figures[name] = reference
    con.close()
    return figures


def _project(spark: Any, warehouse: Any, store: StoreDsn) -> None:
    """Every table es_pipeline keeps: the built-in projections (by Spark), snapshots, the shop's cross-stream
    projection and the typed event tables (by delta-rs)."""
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP, store_dsn=store.extractor)
    update_stream_catalog(Engine(spark=spark), warehouse, store_dsn=store.extractor)
    update_event_type_daily(Engine(spark=spark), warehouse, store_dsn=store.extractor)
    take_snapshots(Engine(spark=spark), warehouse, EventStore(store.snapshots, "es"), threshold=3)
    cross_stream.update(warehouse, SHOP, "sku_sales", store_dsn=store.extractor,
                        frontier=lambda: batch_frontier(store.extractor, SOURCE.consumer))
    event_tables.update(warehouse, SHOP, store_dsn=store.extractor)


EXPECTED = {"events", "stream_state", "stream_catalog", "event_type_daily", "snapshots", "stream_state_cart",
            "stream_state_account", "sku_sales", "event_tables", "events_item_added", "events_deposited",
            "stream_state_cart_history", "stream_state_account_history"}


def test_every_engine_reads_every_table_alike_fresh_compacted_and_after_an_erasure(
    tenant_store: StoreDsn, spark: Any, warehouse: Path
) -> None:
    run_workload(EventStore(tenant_store.writer), streams=40, events=600, writers=3, rollback_rate=0.1,
                 max_commit_delay=0.005, tenants=TENANTS, seed=5)
    for r in split(4):
        Extractor(tenant_store.extractor, None, warehouse, source=SOURCE).run(r)
    _project(spark, warehouse, tenant_store)
    fresh = assert_every_engine_agrees(spark, warehouse, expect=EXPECTED)
    assert fresh["events"]["count"] == 600

    # More commits (small files), then compaction and a vacuum of everything older than now.
    run_workload(EventStore(tenant_store.writer), streams=10, events=120, writers=2, rollback_rate=0,
                 max_commit_delay=0, tenants=TENANTS, seed=6)
    for r in split(4):
        Extractor(tenant_store.extractor, None, warehouse, source=SOURCE).run(r)
    _project(spark, warehouse, tenant_store)
    maintain(warehouse, retain_hours=0, store_dsn=tenant_store.extractor)
    compacted = assert_every_engine_agrees(spark, warehouse, expect=EXPECTED)
    assert compacted["events"]["count"] == 720

    settings = replace(Settings.from_env(), pg_dsn=str(tenant_store), warehouse=warehouse, source_mapping=SOURCE,
                       source_spec="es-tenants", spark_master="local[2]")
    erase_tenant(settings, GONE, wait_seconds=60, progress=lambda _: None)
    # The history tables' deletes recorded stream_state's new position: still bound, no type refolded for them.
    events_id = tables.table_id(tables.table_path(warehouse, "events"))
    read = tables.transaction_version(tables.table_path(warehouse, "stream_state"), stream_state.app_id(events_id))
    assert read is not None and history.unbound(warehouse, SHOP, events_id, read) == []
    _project(spark, warehouse, tenant_store)
    erased = assert_every_engine_agrees(spark, warehouse, expect=EXPECTED)
    with psycopg.connect(tenant_store.extractor) as conn:
        kept = conn.execute("SELECT count(*) FROM es.events").fetchone()[0]  # type: ignore[index]
    assert erased["events"]["count"] == kept < 720
    con, _ = query.duckdb_connection(warehouse)
    for name in [n for n in inventory.lake_tables(warehouse)
                 if n.startswith(event_tables.PREFIX) or n.endswith(history.SUFFIX)]:
        assert con.execute(f"SELECT count(*) FROM \"{name}\" WHERE tenant = '{GONE}'").fetchone()[0] == 0, name
    typed = sum(erased[n]["count"] for n in erased if n.startswith(event_tables.PREFIX))
    assert typed == kept  # every kept event in its typed table, once


def test_every_engine_reads_a_lake_on_s3_alike(dsn: StoreDsn, spark: Any, s3: S3Server) -> None:
    warehouse = s3.bucket("interop")
    run_workload(EventStore(dsn), streams=20, events=300, writers=2, rollback_rate=0.1, max_commit_delay=0.005, seed=2)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP, store_dsn=dsn.extractor)
    event_tables.update(warehouse, SHOP, store_dsn=dsn.extractor)
    figures = assert_every_engine_agrees(spark, warehouse, expect={"events", "stream_state", "event_tables",
                                                                    "events_item_added"})
    assert figures["events"]["count"] == 300
    answer = query.run(warehouse, "SELECT count(*) AS n FROM events_item_added")
    assert answer.rows.to_pylist() == [{"n": figures["events_item_added"]["count"]}]
