"""Snapshots without a JVM take the same snapshots as Spark, and either engine sees what the other took."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.dev.workload import run_workload
from es_pipeline.domain import Domain, Event
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.lake.delta import tables
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state import snapshots
from es_pipeline.lake.state.snapshots import app_id, latest, take_snapshots
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.roles import StoreDsn
from es_pipeline_tests.support.store import stored_snapshots


def test_latest_is_the_highest_version_then_the_last_taken_per_stream_and_tenant() -> None:
    at = [datetime(2026, 11, 28, h, tzinfo=UTC) for h in range(8)]
    rows = pa.table({"stream_id": ["a", "b", "a", "a", "b", "a", "c", "c"], "version": [5, 3, 9, 9, 3, 2, 4, 4],
                     "revision": [1, 1, 1, 2, 4, 1, 2, 1], "state": ["a5", "b3r1", "a9r1", "a9r2", "b3r4", "t2a2",
                                                                    "c4r2", "c4r1 again"],
                     "tenant": ["", "", "", "", "", "t2", "", ""], "taken_at": at})
    assert sorted(latest(rows).drop_columns(["taken_at"]).to_pylist(), key=lambda r: (r["tenant"], r["stream_id"])) == [
        {"stream_id": "a", "version": 9, "revision": 2, "state": "a9r2", "tenant": ""},
        {"stream_id": "b", "version": 3, "revision": 4, "state": "b3r4", "tenant": ""},
        # Revision 2 rolled back to 1: the take after it is the latest, not the higher revision.
        {"stream_id": "c", "version": 4, "revision": 1, "state": "c4r1 again", "tenant": ""},
        {"stream_id": "a", "version": 2, "revision": 1, "state": "t2a2", "tenant": "t2"},
    ]


def _taken(warehouse: Path) -> list[tuple[str, str, int, Any, int]]:
    """Every snapshot in the lake: (stream, type, version, state, revision), sorted."""
    t = DeltaTable(tables.table_path(warehouse, "snapshots")).to_pyarrow_table(
        columns=["stream_id", "stream_type", "version", "state", "revision"])
    return sorted((r["stream_id"], r["stream_type"], r["version"], json.loads(r["state"]), r["revision"])
                  for r in t.to_pylist())


def test_small_and_spark_paths_take_the_same_snapshots_and_see_each_others(
    dsn: StoreDsn, spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = EventStore(dsn.snapshots)
    small, big = tmp_path / "small", tmp_path / "spark"
    big.mkdir()
    for round_ in range(3):
        run_workload(EventStore(dsn.writer), streams=40, events=400, writers=2, rollback_rate=0, max_commit_delay=0,
                     seed=round_)
        Extractor(dsn.extractor, spark, small).run(SliceRange(0, 1023))
        update_stream_state(Engine(spark=spark), small, domain=SHOP)
        # The same stream_state, log and all, beside it (one store feeds one lake: its offsets say which).
        shutil.rmtree(big / "stream_state", ignore_errors=True)
        shutil.copytree(small / "stream_state", big / "stream_state")
        on_small = take_snapshots(Engine(), small, store, threshold=4)  # no Spark session: it must not need one
        on_spark = take_snapshots(Engine("spark", spark), big, store, threshold=4)  # ES_PIPELINE_ENGINE=spark
        assert (on_small.engine, on_spark.engine) == ("local", "spark")
        assert on_small.figures["taken"] == on_spark.figures["taken"] > 0
        assert _taken(small) == _taken(big)
        assert on_small.events_version == on_spark.events_version
    # The store holds each stream's latest snapshot of the lake, row by row.
    lake = {s: (v, r, state) for s, _, v, state, r in _taken(small)}
    assert stored_snapshots(dsn) == lake

    # A replay of the same stream_state version appends nothing, on either path, over the other's commit.
    version = DeltaTable(tables.table_path(small, "snapshots")).version()
    assert take_snapshots(Engine(), small, store, threshold=1).figures["taken"] == 0
    take_snapshots(Engine(spark=spark, small_increments=False), small, store, threshold=1)
    assert DeltaTable(tables.table_path(small, "snapshots")).version() == version
    assert DeltaTable(tables.table_path(small, "snapshots")).transaction_version(
        app_id(tables.table_path(small, "stream_state"))) == on_small.events_version

    # A lost write-back is redone by the small path.
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("DELETE FROM es.snapshots WHERE stream_id IN "
                            "(SELECT stream_id FROM es.snapshots ORDER BY stream_id LIMIT 3)").rowcount == 3
    assert take_snapshots(Engine(), small, store, threshold=4).figures["written_back"] == 3
    assert stored_snapshots(dsn) == lake

    # ES_PIPELINE_ENGINE=local keeps a take past the streams bound in process (no Spark session to ask for).
    monkeypatch.setattr(snapshots, "SMALL_SNAPSHOTS", 0)
    assert take_snapshots(Engine("local"), small, store, threshold=1).engine == "local"


def test_a_revision_rolled_back_is_snapshotted_once_and_written_back(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    """Revision 2 swapped in and snapshotted, then revision 1 again: the store gets revision 1's state back, and later
    takes append nothing more for a stream whose version has not moved."""
    writer, store = EventStore(dsn.writer), EventStore(dsn.snapshots)
    writer.append("cart-1", "cart", [NewEvent("ItemAdded", {"sku": "a", "qty": 2, "unit_price": 1.5})], 0)

    def cart_v2(state: dict[str, Any], event: Event) -> dict[str, Any]:
        return {**SHOP.reducers["cart"].fold(state, event), "v2": True}

    v2 = Domain("shop, carts v2")
    v2.add(SHOP.reducers["account"])
    v2.reducer("cart", revision=5)(cart_v2)
    one, two = SHOP.revisions()["cart"], v2.revisions()["cart"]  # a revision counts the upcasters too
    assert one != two
    extract = Extractor(dsn.extractor, None, warehouse)
    for domain, revision in ((SHOP, one), (v2, two), (SHOP, one)):
        extract.run(SliceRange(0, 1023))
        update_stream_state(Engine(spark=spark), warehouse, domain=domain)
        assert take_snapshots(Engine(), warehouse, store, threshold=1).figures["taken"] == 1, f"revision {revision} taken once"
        assert stored_snapshots(dsn)["cart-1"][:2] == (1, revision), "the store holds the revision in service"
    # Another stream moves stream_state on; the cart, unchanged, is not taken again.
    writer.append("cart-2", "cart", [NewEvent("ItemAdded", {"sku": "b"})], 0)
    extract.run(SliceRange(0, 1023))
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    assert take_snapshots(Engine(), warehouse, store, threshold=1).figures["taken"] == 1
    taken = DeltaTable(tables.table_path(warehouse, "snapshots")).to_pyarrow_table(
        columns=["stream_id", "version", "revision"]).to_pylist()
    assert sorted((r["stream_id"], r["version"], r["revision"]) for r in taken) == sorted([
        ("cart-1", 1, one), ("cart-1", 1, two), ("cart-1", 1, one), ("cart-2", 1, one)])
    assert stored_snapshots(dsn)["cart-1"][:2] == (1, one)
