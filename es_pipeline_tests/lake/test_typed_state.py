"""Typed state (lake/typed_state.py): a table per declared state, equal field by field to a fold of the store."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.dev.workload import run_workload
from es_pipeline.domain import Domain, Event, Reducer
from es_pipeline.errors import TypedStateMismatch
from es_pipeline.lake import typed_state
from es_pipeline.lake.stream_state import update_stream_state
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.lake.test_stream_state import full_replay
from es_pipeline_tests.support.lakecheck import extract_all
from es_pipeline_tests.support.roles import StoreDsn


def _no_spark() -> Any:
    raise AssertionError("asked for a Spark session")


def _typed(warehouse: Path, name: str) -> dict[str, dict[str, Any]]:
    rows = DeltaTable(str(warehouse / name)).to_pyarrow_table().to_pylist()
    return {r["stream_id"]: r for r in rows}


def _as_plain(value: Any) -> Any:
    """A typed column's value as the JSON state has it (Arrow's maps read back as lists of pairs)."""
    if isinstance(value, list) and all(isinstance(v, tuple) and len(v) == 2 for v in value):
        return dict(value)
    return value


def _types(dsn: StoreDsn) -> dict[str, str]:
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute("SELECT DISTINCT stream_id, stream_type FROM es.events").fetchall())


def _assert_typed_equal_replay(dsn: StoreDsn, warehouse: Path) -> int:
    replay, types = full_replay(dsn), _types(dsn)
    checked = 0
    for table, stream_type in (("stream_state_cart", "cart"), ("stream_state_account", "account")):
        typed = _typed(warehouse, table)
        fields = [f.name for f in SHOP.reducers[stream_type].state or []]
        expected = {sid: (v, s) for sid, (v, s) in replay.items() if types[sid] == stream_type}
        assert set(typed) == set(expected), (table, set(typed) ^ set(expected))
        for sid, (version, state) in expected.items():
            row = typed[sid]
            assert row["version"] == version and row["revision"] == SHOP.revisions()[stream_type]
            assert {f: _as_plain(row[f]) for f in fields} == {f: state.get(f) for f in fields}, sid
            checked += 1
    assert checked == len(replay)
    return checked


def test_typed_tables_equal_a_fold_of_the_store_through_first_build_small_increments_and_spark(
    dsn: StoreDsn, spark: Any, warehouse: Path
) -> None:
    store = EventStore(dsn)
    run_workload(store, streams=40, events=400, writers=2, rollback_rate=0.1, max_commit_delay=0, seed=21)
    extract_all(dsn.extractor, None, warehouse)
    built = update_stream_state(_no_spark, warehouse, domain=SHOP)
    assert sum(n for _, n in built.typed_rows) == 40 and len(built.typed_rows) == 2
    assert _assert_typed_equal_replay(dsn, warehouse) >= 40
    run_workload(store, streams=40, events=200, writers=2, rollback_rate=0, max_commit_delay=0, seed=22)
    extract_all(dsn.extractor, None, warehouse)
    small = update_stream_state(_no_spark, warehouse, domain=SHOP)  # the small increment: only the streams it touched
    assert 0 < sum(n for _, n in small.typed_rows) <= small.streams_updated
    assert _assert_typed_equal_replay(dsn, warehouse) >= 40
    run_workload(store, streams=40, events=200, writers=2, rollback_rate=0, max_commit_delay=0, seed=23)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(spark, warehouse, domain=SHOP, small_increments=False)  # Spark's MERGE feeds them alike
    assert _assert_typed_equal_replay(dsn, warehouse) >= 40
    again = update_stream_state(_no_spark, warehouse, domain=SHOP)
    assert again.typed_rows == () and again.events_folded == 0
    # Typed columns read as such by Spark: no JSON to parse.
    open_carts = spark.read.format("delta").load(str(warehouse / "stream_state_cart")).where("status = 'open'").count()
    assert open_carts == sum(1 for s, (_, st) in full_replay(dsn).items() if _types(dsn)[s] == "cart" and st["status"] == "open")


@dataclass
class _AccountV2:
    owner: str | None
    balance: float
    opened: bool | None


def test_a_changed_declaration_rebuilds_that_table_alone_and_a_state_that_does_not_fit_is_named(
    dsn: StoreDsn, spark: Any, warehouse: Path
) -> None:
    store = EventStore(dsn)
    store.append("account-1", "account", [NewEvent("Opened", {"owner": "o", "currency": "EUR"}),
                                          NewEvent("Deposited", {"amount": 5})], 0)
    store.append("cart-1", "cart", [NewEvent("ItemAdded", {"sku": "a", "unit_price": 2.0})], 0)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(_no_spark, warehouse, domain=SHOP)
    cart_rows = _typed(warehouse, "stream_state_cart")

    def account_v2(state: dict[str, Any], event: Event) -> dict[str, Any]:
        return {**SHOP.reducers["account"].fold(state, event), "opened": True}

    v2 = Domain("shop, accounts v2")
    v2.add(SHOP.reducers["cart"])
    for upcaster in SHOP.upcasters.values():  # the carts' upcaster kept: carts are not rebuilt
        v2.add_upcaster(upcaster)
    v2.reducer("account", revision=2, state=_AccountV2)(account_v2)
    result = update_stream_state(spark, warehouse, domain=v2)  # a revision rebuild is Spark's
    assert result.rebuilt_types == ("account",)
    account = _typed(warehouse, "stream_state_account")["account-1"]
    assert (account["owner"], account["balance"], account["opened"], account["revision"]) == ("o", 5.0, True, 2)
    assert "currency" not in account
    assert _typed(warehouse, "stream_state_cart") == cart_rows  # untouched (a commit records the version read)

    def misfit(state: dict[str, Any], event: Event) -> dict[str, Any]:
        return {"owner": "o", "balance": "a lot", "opened": True}

    bad = Domain("shop, a misfit")
    bad.add(SHOP.reducers["cart"])
    for upcaster in SHOP.upcasters.values():
        bad.add_upcaster(upcaster)
    bad.add(Reducer("account", 3, misfit, "bad", v2.reducers["account"].state))
    with pytest.raises(TypedStateMismatch, match=r"'account-1' \(account\).*field 'balance' holds 'a lot'"):
        update_stream_state(spark, warehouse, domain=bad)
    states = {r["stream_id"]: r for r in DeltaTable(str(warehouse / "stream_state")).to_pyarrow_table().to_pylist()}
    assert json.loads(states["account-1"]["state"])["balance"] == "a lot"  # stream_state is committed; the table waits
    # The reducer fixed (back to v2): the table catches up over both of stream_state's commits since it was written.
    update_stream_state(spark, warehouse, domain=v2)
    account = _typed(warehouse, "stream_state_account")["account-1"]
    assert (account["balance"], account["revision"]) == (5.0, 2)


@dataclass
class Line:
    sku: str
    qty: int


@dataclass
class Order:
    lines: list[Line]
    note: str | None


def test_a_state_declared_as_an_arrow_schema_or_with_nested_fields() -> None:
    d = Domain("orders")
    d.reducer("order", revision=1, state=Order)(lambda s, e: s)
    d.reducer("refund", revision=1, state=pa.schema([("amount", pa.float64())]))(lambda s, e: s)
    typed = typed_state.typed_tables(d)
    assert typed["order"][1].name == "stream_state_order"
    assert typed["order"][1].schema.field("lines").type == pa.list_(pa.struct([("sku", pa.string()), ("qty", pa.int64())]))
    assert typed["refund"][1].schema.names[-1] == "amount"
    assert typed_state.table_name("Order Line.v2") == "stream_state_order_line_v2"


def test_a_lake_folded_before_its_states_were_declared_gets_its_typed_tables_whole(
    dsn: StoreDsn, warehouse: Path
) -> None:
    """stream_state made without its change feed (no declaration then): the first update with declarations turns
    the feed on and builds every typed table from stream_state; the next increment follows the feed."""
    untyped = Domain("shop, untyped")
    for reducer in SHOP.reducers.values():
        untyped.add(Reducer(reducer.stream_type, reducer.revision, reducer.fold, reducer.domain))
    for upcaster in SHOP.upcasters.values():  # the same revisions: no type rebuilt when the states are declared
        untyped.add_upcaster(upcaster)
    store = EventStore(dsn)
    run_workload(store, streams=20, events=200, writers=2, rollback_rate=0, max_commit_delay=0, seed=31)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(_no_spark, warehouse, domain=untyped)
    assert not (warehouse / "stream_state_cart").exists()
    upgraded = update_stream_state(_no_spark, warehouse, domain=SHOP)
    assert upgraded.events_folded == 0 and sum(n for _, n in upgraded.typed_rows) == 20
    _assert_typed_equal_replay(dsn, warehouse)
    run_workload(store, streams=20, events=100, writers=2, rollback_rate=0, max_commit_delay=0, seed=32)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(_no_spark, warehouse, domain=SHOP)
    _assert_typed_equal_replay(dsn, warehouse)


def test_a_typed_table_its_type_did_not_move_is_left_alone_then_catches_up_from_the_change_feed(
    dsn: StoreDsn, warehouse: Path
) -> None:
    """Increments that fold accounts only leave `stream_state_cart` alone (no load, no commit); the next one that
    moves a cart brings it the commits it missed from `stream_state`'s change feed: an old cart's update and a new
    cart, equal to a fold of the store."""
    store = EventStore(dsn)
    store.append("cart-1", "cart", [NewEvent("ItemAdded", {"sku": "a", "qty": 1, "unit_price": 2.0})], 0)
    store.append("account-1", "account", [NewEvent("Opened", {"owner": "o", "currency": "EUR"})], 0)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(_no_spark, warehouse, domain=SHOP)
    update_stream_state(_no_spark, warehouse, domain=SHOP)  # nothing new: every table found with its columns
    cart_version = DeltaTable(str(warehouse / "stream_state_cart")).version()
    for n in range(3):
        store.append("account-1", "account", [NewEvent("Deposited", {"amount": n + 1})], n + 1)
        extract_all(dsn.extractor, None, warehouse)
        moved = update_stream_state(_no_spark, warehouse, domain=SHOP)
        assert dict(moved.typed_rows) == {"stream_state_account": 1}
    assert DeltaTable(str(warehouse / "stream_state_cart")).version() == cart_version  # left alone
    _assert_typed_equal_replay(dsn, warehouse)
    store.append("cart-1", "cart", [NewEvent("ItemAdded", {"sku": "b", "qty": 2, "unit_price": 1.0})], 1)
    store.append("cart-2", "cart", [NewEvent("ItemAdded", {"sku": "c", "qty": 1, "unit_price": 5.0})], 0)
    extract_all(dsn.extractor, None, warehouse)
    caught_up = update_stream_state(_no_spark, warehouse, domain=SHOP)
    assert dict(caught_up.typed_rows) == {"stream_state_cart": 2}
    _assert_typed_equal_replay(dsn, warehouse)
