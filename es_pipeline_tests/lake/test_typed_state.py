"""Typed state (lake/state/typed_state.py): a table per declared state, equal field by field to a fold of the store."""

from __future__ import annotations

import datetime as dt
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
from es_pipeline.errors import ReducerError
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state import typed_state
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.lake.test_stream_state import full_replay
from es_pipeline_tests.support.hooks import no_spark
from es_pipeline_tests.support.lakecheck import extract_all
from es_pipeline_tests.support.roles import StoreDsn


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
    built = update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)
    assert sum(built.per("typed_rows").values()) == 40 and len(built.per("typed_rows")) == 2
    assert _assert_typed_equal_replay(dsn, warehouse) >= 40
    run_workload(store, streams=40, events=200, writers=2, rollback_rate=0, max_commit_delay=0, seed=22)
    extract_all(dsn.extractor, None, warehouse)
    small = update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)  # the small increment: only the streams it touched
    assert 0 < sum(small.per("typed_rows").values()) <= small.figures["streams_updated"]
    assert _assert_typed_equal_replay(dsn, warehouse) >= 40
    run_workload(store, streams=40, events=200, writers=2, rollback_rate=0, max_commit_delay=0, seed=23)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=spark, small_increments=False), warehouse, domain=SHOP)  # Spark's MERGE feeds them alike
    assert _assert_typed_equal_replay(dsn, warehouse) >= 40
    again = update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)
    assert again.per("typed_rows") == {} and again.events_folded == 0
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
    update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)
    cart_rows = _typed(warehouse, "stream_state_cart")

    def account_v2(state: dict[str, Any], event: Event) -> dict[str, Any]:
        return {**SHOP.reducers["account"].fold(state, event), "opened": True}

    v2 = Domain("shop, accounts v2")
    v2.add(SHOP.reducers["cart"])
    for upcaster in SHOP.upcasters.values():  # the carts' upcaster kept: carts are not rebuilt
        v2.add_upcaster(upcaster)
    v2.reducer("account", revision=2, state=_AccountV2)(account_v2)
    result = update_stream_state(Engine(spark=spark), warehouse, domain=v2)  # a revision rebuild is Spark's
    assert result.listed("rebuilt_types") == ("account",)
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
    state_version = DeltaTable(str(warehouse / "stream_state")).version()
    with pytest.raises(ReducerError, match=r"stream 'account-1' version 2 \(Deposited\): its state's field 'balance' "
                                           r"holds a str \(declared double"):
        update_stream_state(Engine(spark=spark), warehouse, domain=bad.folding("stop"))
    assert DeltaTable(str(warehouse / "stream_state")).version() == state_version  # nothing committed
    update_stream_state(Engine(spark=spark), warehouse, domain=v2)
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
        untyped.add(Reducer(reducer.stream_type, reducer.revision, reducer.fold, reducer.domain,
                            history=reducer.history))  # history kept alike: turning it on would rebuild on Spark
    for upcaster in SHOP.upcasters.values():  # the same revisions: no type rebuilt when the states are declared
        untyped.add_upcaster(upcaster)
    store = EventStore(dsn)
    run_workload(store, streams=20, events=200, writers=2, rollback_rate=0, max_commit_delay=0, seed=31)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=no_spark), warehouse, domain=untyped)
    assert not (warehouse / "stream_state_cart").exists()
    upgraded = update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)
    assert upgraded.events_folded == 0 and sum(upgraded.per("typed_rows").values()) == 20
    _assert_typed_equal_replay(dsn, warehouse)
    run_workload(store, streams=20, events=100, writers=2, rollback_rate=0, max_commit_delay=0, seed=32)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)
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
    update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)
    update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)  # nothing new: every table found with its columns
    cart_version = DeltaTable(str(warehouse / "stream_state_cart")).version()
    for n in range(3):
        store.append("account-1", "account", [NewEvent("Deposited", {"amount": n + 1})], n + 1)
        extract_all(dsn.extractor, None, warehouse)
        moved = update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)
        assert moved.per("typed_rows") == {"stream_state_account": 1}
    assert DeltaTable(str(warehouse / "stream_state_cart")).version() == cart_version  # left alone
    _assert_typed_equal_replay(dsn, warehouse)
    store.append("cart-1", "cart", [NewEvent("ItemAdded", {"sku": "b", "qty": 2, "unit_price": 1.0})], 1)
    store.append("cart-2", "cart", [NewEvent("ItemAdded", {"sku": "c", "qty": 1, "unit_price": 5.0})], 0)
    extract_all(dsn.extractor, None, warehouse)
    caught_up = update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)
    assert caught_up.per("typed_rows") == {"stream_state_cart": 2}
    _assert_typed_equal_replay(dsn, warehouse)


@dataclass
class _Visit:
    at: dt.datetime
    place: str


@dataclass
class _Ticket:
    opened_at: dt.datetime
    due: dt.date
    last: _Visit | None
    days: list[dt.date]
    places: dict[str, int]
    open_seconds: float | None


def _ticket(state: dict[str, Any], event: Event) -> dict[str, Any]:
    """Natural Python values throughout: the next run's fold must see datetimes again, or `-` fails."""
    p = event.payload
    if event.event_type == "Opened":
        return {"opened_at": dt.datetime.fromisoformat(p["at"]), "due": dt.date.fromisoformat(p["due"]), "last": None,
                "days": [], "places": {}, "open_seconds": None}
    at = dt.datetime.fromisoformat(p["at"])
    if event.event_type == "Visited":
        places = dict(state["places"])
        places[p["place"]] = places.get(p["place"], 0) + 1
        return {**state, "last": {"at": at, "place": p["place"]}, "days": [*state["days"], at.date()], "places": places}
    return {**state, "open_seconds": (at - state["opened_at"]).total_seconds(), "due": max(state["due"], at.date())}


def _tickets(fold: Any = _ticket) -> Domain:
    d = Domain("tickets")
    d.reducer("ticket", revision=1, state=_Ticket)(fold)
    return d


def test_a_typed_state_round_trips_dates_times_nested_and_optional_values(dsn: StoreDsn, spark: Any,
                                                                          warehouse: Path) -> None:
    store = EventStore(dsn)
    store.append("t-1", "ticket", [NewEvent("Opened", {"at": "2026-11-27T09:00:00+01:00", "due": "2026-12-01"}),
                                   NewEvent("Visited", {"at": "2026-11-27T10:30:00+00:00", "place": "desk"})], 0)
    store.append("t-2", "ticket", [NewEvent("Opened", {"at": "2026-11-27T08:00:00+00:00", "due": "2026-12-02"})], 0)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=no_spark), warehouse, domain=_tickets())
    store.append("t-1", "ticket", [NewEvent("Visited", {"at": "2026-12-03T11:00:00+00:00", "place": "desk"}),
                                   NewEvent("Closed", {"at": "2026-12-03T12:00:00+00:00"})], 2)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=no_spark), warehouse, domain=_tickets())  # folds on from the JSON the first run wrote

    utc = dt.UTC
    one = _typed(warehouse, "stream_state_ticket")
    assert one["t-1"]["opened_at"] == dt.datetime(2026, 11, 27, 8, tzinfo=utc)  # the moment, in UTC
    assert one["t-1"]["due"] == dt.date(2026, 12, 3) and one["t-2"]["due"] == dt.date(2026, 12, 2)
    assert one["t-1"]["last"] == {"at": dt.datetime(2026, 12, 3, 11, tzinfo=utc), "place": "desk"}
    assert one["t-1"]["days"] == [dt.date(2026, 11, 27), dt.date(2026, 12, 3)] and one["t-1"]["places"] == [("desk", 2)]
    assert one["t-1"]["open_seconds"] == (dt.datetime(2026, 12, 3, 12) - dt.datetime(2026, 11, 27, 8)).total_seconds()
    assert one["t-2"]["last"] is None and one["t-2"]["open_seconds"] is None and one["t-2"]["days"] == []
    state = json.loads(next(r["state"] for r in DeltaTable(str(warehouse / "stream_state")).to_pyarrow_table()
                            .to_pylist() if r["stream_id"] == "t-1"))
    assert state["opened_at"] == "2026-11-27T08:00:00+00:00" and state["due"] == "2026-12-03"  # JSON for any reader
    # Built at once on Spark (a new revision): the same table as the increments made.
    again = Domain("tickets, again")
    again.reducer("ticket", revision=2, state=_Ticket)(_ticket)
    assert update_stream_state(Engine(spark=spark), warehouse, domain=again).listed("rebuilt_types") == ("ticket",)
    assert {k: {c: v for c, v in r.items() if c not in ("revision", "updated_at")} for k, r in
            _typed(warehouse, "stream_state_ticket").items()} == \
        {k: {c: v for c, v in r.items() if c not in ("revision", "updated_at")} for k, r in one.items()}


def test_a_state_that_does_not_fit_names_its_stream_version_and_field_and_commits_nothing(dsn: StoreDsn,
                                                                                          warehouse: Path) -> None:
    store = EventStore(dsn)
    store.append("t-1", "ticket", [NewEvent("Opened", {"at": "2026-11-27T09:00:00+01:00", "due": "2026-12-01"})], 0)
    extract_all(dsn.extractor, None, warehouse)
    cases = (
        (lambda s, e: {**_ticket(s, e), "opened_at": e.payload["at"]}, "field 'opened_at' holds a str \\(declared a "
                                                                       "datetime: return a datetime\\)"),
        (lambda s, e: {**_ticket(s, e), "opened_at": 1_700_000_000}, "field 'opened_at' holds a int"),
        (lambda s, e: {**_ticket(s, e), "opened_at": dt.datetime(2026, 11, 27)}, "without a time zone"),
        (lambda s, e: {**_ticket(s, e), "last": {"at": dt.datetime.now(dt.UTC), "place": ["x"]}}, "field 'last.place' holds a list"),
        (lambda s, e: {**_ticket(s, e), "price": dt.date(2026, 1, 1)}, "field 'price' holds a date \\(it has no "
                                                                        "JSON form"),
    )
    for fold, says in cases:
        with pytest.raises(ReducerError, match=f"stream 't-1' version 1 \\(Opened\\): its state's .*{says}"):
            update_stream_state(Engine(spark=no_spark), warehouse, domain=_tickets(fold).folding("stop"))
        assert not (warehouse / "stream_state").exists() or DeltaTable(str(warehouse / "stream_state")).version() <= 0
