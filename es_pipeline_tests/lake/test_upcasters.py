"""Upcasters: old payloads brought to the current shape before a reducer sees them; chains compose; registering
one rebuilds the stream types it applies to. A history written as v1, v2 and v3 by the store's own writer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from es_pipeline.domain import Domain, Event
from es_pipeline.errors import DomainError
from es_pipeline.lake import cross_stream
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.hooks import no_spark
from es_pipeline_tests.support.lakecheck import extract_all
from es_pipeline_tests.support.roles import StoreDsn


def _order(state: dict[str, Any], event: Event) -> dict[str, Any]:
    """Knows the current shape (v3) of ItemAdded only: {"sku", "qty", "unit_price": {"amount", "currency"}}."""
    if event.event_type == "ItemAdded":
        p = event.payload
        lines = {**state.get("lines", {}), p["sku"]: p["qty"] * p["unit_price"]["amount"]}
        return {"lines": lines, "currency": p["unit_price"]["currency"], "types": [*state.get("types", []),
                                                                                    event.event_type]}
    return state


def _v1_to_v2(p: dict[str, Any]) -> dict[str, Any]:  # {"price"} → {"unit_price", "currency"}
    return {"sku": p["sku"], "qty": p.get("qty", 1), "unit_price": p["price"], "currency": "EUR"}


def _v2_to_v3(p: dict[str, Any]) -> dict[str, Any]:  # flat price and currency → one object
    return {"sku": p["sku"], "qty": p["qty"], "unit_price": {"amount": p["unit_price"], "currency": p["currency"]}}


def _orders(source: str = "suffix") -> Domain:
    d = Domain("orders", schema_version=source)
    d.reducer("order", revision=1)(_order)
    d.upcaster("ItemAdded", version=1)(_v1_to_v2)
    d.upcaster("ItemAdded", version=2)(_v2_to_v3)
    return d


def test_a_history_written_as_v1_v2_and_v3_folds_as_if_written_today_and_a_new_upcaster_rebuilds_its_types(
    dsn: StoreDsn, spark: Any, warehouse: Path
) -> None:
    store = EventStore(dsn)
    store.append("order-1", "order", [NewEvent("ItemAdded", {"sku": "a", "qty": 2, "price": 1.5})], 0)  # v1
    store.append("order-1", "order", [NewEvent("ItemAdded.v2", {"sku": "b", "qty": 1, "unit_price": 4.0,
                                                                "currency": "EUR"})], 1)
    store.append("order-1", "order", [NewEvent("ItemAdded.v3", {"sku": "c", "qty": 3, "unit_price": {
        "amount": 1.0, "currency": "EUR"}})], 2)
    store.append("account-1", "account", [NewEvent("Opened", {"owner": "o", "currency": "EUR"})], 0)
    extract_all(dsn.extractor, None, warehouse)
    orders = _orders()
    built = update_stream_state(Engine(spark=no_spark), warehouse, domain=orders)
    rows = _rows(warehouse)
    assert json.loads(rows["order-1"]["state"]) == {
        "lines": {"a": 3.0, "b": 4.0, "c": 3.0}, "currency": "EUR", "types": ["ItemAdded"] * 3}
    assert rows["order-1"]["revision"] == 3 == orders.revisions()["order"]  # the reducer's 1, and two upcasters
    assert built.figures["streams_without_reducer"] == 1  # the account: no reducer here

    store.append("order-2", "order", [NewEvent("ItemAdded", {"sku": "z", "price": 2.0})], 0)
    extract_all(dsn.extractor, None, warehouse)
    assert update_stream_state(Engine(spark=no_spark), warehouse, domain=orders).events_folded == 1  # the small increment
    assert json.loads(_rows(warehouse)["order-2"]["state"])["lines"] == {"z": 2.0}

    # A third upcaster (v3 → v4: currencies lower-case) is a revision change: `order` is rebuilt, from v1.
    def _v3_to_v4(p: dict[str, Any]) -> dict[str, Any]:
        return {**p, "unit_price": {**p["unit_price"], "currency": p["unit_price"]["currency"].lower()}}

    orders.upcaster("ItemAdded", version=3)(_v3_to_v4)
    rebuilt = update_stream_state(Engine(spark=spark), warehouse, domain=orders)  # a revision rebuild is Spark's
    assert rebuilt.listed("rebuilt_types") == ("order",)
    after = _rows(warehouse)
    assert {s: (after[s]["revision"], json.loads(after[s]["state"])["currency"]) for s in ("order-1", "order-2")} == {
        "order-1": (4, "eur"), "order-2": (4, "eur")}


def _rows(warehouse: Path) -> dict[str, dict[str, Any]]:
    return {r["stream_id"]: r for r in DeltaTable(str(warehouse / "stream_state")).to_pyarrow_table().to_pylist()}


def _fold(domain: Domain, stream_type: str, events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    fold, state = domain.folds[stream_type].fold, {}
    for v, (event_type, payload) in enumerate(events, start=1):
        state = fold(state, Event("s", v, event_type, payload))
    return state


def test_schema_versions_read_from_a_payload_field_or_nowhere() -> None:
    by_field = _orders("field:schema")
    state = _fold(by_field, "order", [("ItemAdded", {"sku": "a", "price": 2.0}),
                                      ("ItemAdded", {"schema": 3, "sku": "b", "qty": 1,
                                                     "unit_price": {"amount": 1.0, "currency": "EUR"}})])
    assert state["lines"] == {"a": 2.0, "b": 1.0}
    # Without versions every payload is at 1: such an upcaster recognises the old shape itself.
    none = Domain("orders")
    none.reducer("order", revision=1)(_order)
    none.upcaster("ItemAdded", version=1)(lambda p: p if isinstance(p.get("unit_price"), dict) else _v2_to_v3(_v1_to_v2(p)))
    assert _fold(none, "order", [("ItemAdded", {"sku": "a", "price": 2.0})])["lines"] == {"a": 2.0}
    assert none.revisions() == {"order": 2}


def test_upcasters_apply_to_the_stream_types_they_name_and_conflicts_are_refused() -> None:
    d = Domain("d")
    d.reducer("order", revision=1)(_order)
    d.reducer("cart", revision=5)(lambda s, e: s)
    d.upcaster("ItemAdded", version=1, stream_types=["order"])(_v1_to_v2)
    assert d.revisions() == {"order": 2, "cart": 5}
    with pytest.raises(DomainError, match="two upcasters take 'ItemAdded' at version 1"):
        d.upcaster("ItemAdded", version=1)(_v2_to_v3)
    with pytest.raises(DomainError, match="field:v and suffix"):
        Domain.merged([_orders("suffix"), _orders("field:v")])
    with pytest.raises(DomainError, match="reads schema versions from 'payload'"):
        Domain("x", schema_version="payload")


@pytest.mark.parametrize("path", ["in-process first build, then a small increment", "Spark"])
def test_schema_versions_read_from_the_events_metadata(dsn: StoreDsn, spark: Any, warehouse: Path, path: str) -> None:
    """`metadata:schema_version`: the version is a field of each event's metadata (absent: 1), written there by the
    store's writer; every path of the fold and a cross-stream projection read it, and reducers see plain types."""
    orders = _orders("metadata:schema_version")

    @orders.projection("sku_lines", events=["ItemAdded"], key="sku", revision=1)
    def sku_lines(state: dict[str, Any], event: Event) -> dict[str, Any]:
        amount = event.payload["qty"] * event.payload["unit_price"]["amount"]
        return {"amount": state.get("amount", 0) + amount, "type": event.event_type}

    store = EventStore(dsn)
    store.append("order-1", "order", [NewEvent("ItemAdded", {"sku": "a", "qty": 2, "price": 1.5})], 0)  # v1: no field
    store.append("order-1", "order", [NewEvent("ItemAdded", {"sku": "b", "qty": 1, "unit_price": 4.0, "currency": "EUR"},
                                               {"schema_version": 2})], 1)
    store.append("order-2", "order", [NewEvent("ItemAdded", {"sku": "a", "qty": 3, "unit_price": {
        "amount": 1.0, "currency": "EUR"}}, {"schema_version": "3", "user": "u"})], 0)
    # Versions that are no whole number from 1 are 1, on every path alike.
    store.append("order-3", "order", [NewEvent("ItemAdded", {"sku": "d", "qty": 1, "price": 2.0}, {"schema_version": v})
                                      for v in ("nope", 2.5, 0, True)], 0)
    extract_all(dsn.extractor, None, warehouse)
    if path == "Spark":
        update_stream_state(Engine(spark=spark, small_increments=False), warehouse, domain=orders)
    else:
        update_stream_state(Engine(spark=no_spark), warehouse, domain=orders)
    rows = _rows(warehouse)
    assert json.loads(rows["order-1"]["state"]) == {"lines": {"a": 3.0, "b": 4.0}, "currency": "EUR",
                                                    "types": ["ItemAdded", "ItemAdded"]}
    assert json.loads(rows["order-2"]["state"])["lines"] == {"a": 3.0}
    assert json.loads(rows["order-3"]["state"])["lines"] == {"d": 2.0} and rows["order-3"]["version"] == 4
    store.append("order-2", "order", [NewEvent("ItemAdded", {"sku": "c", "qty": 1, "unit_price": 2.0,
                                                             "currency": "EUR"}, {"schema_version": 2})], 1)
    extract_all(dsn.extractor, None, warehouse)
    if path == "Spark":
        update_stream_state(Engine(spark=spark, small_increments=False), warehouse, domain=orders)
    else:
        assert update_stream_state(Engine(spark=no_spark), warehouse, domain=orders).events_folded == 1  # the small increment
    assert json.loads(_rows(warehouse)["order-2"]["state"])["lines"] == {"a": 3.0, "c": 2.0}
    cross_stream.update(warehouse, orders, "sku_lines")
    held = {r["sku"]: json.loads(r["state"]) for r in DeltaTable(str(warehouse / "sku_lines")).to_pyarrow_table().to_pylist()}
    assert held == {"a": {"amount": 6.0, "type": "ItemAdded"}, "b": {"amount": 4.0, "type": "ItemAdded"},
                    "c": {"amount": 2.0, "type": "ItemAdded"}, "d": {"amount": 8.0, "type": "ItemAdded"}}


def test_a_schema_version_source_is_one_of_four() -> None:
    with pytest.raises(DomainError, match="metadata:<name>"):
        Domain("x", schema_version="metadata:")
    assert Domain("x", schema_version="metadata:v").versioned_type("A", {"v": 7}) == "A.v7"
    assert Domain("x", schema_version="metadata:v").versioned_type("A", {"v": "nope"}) == "A.v1"
    assert Domain("x").versioned_type("A", {"v": 7}) == "A"
