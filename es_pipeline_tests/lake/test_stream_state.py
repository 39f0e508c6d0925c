"""`stream_state`: incremental folds equal a full replay, event by event; revisions; bad events."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
from shop.domain import domain as SHOP

from es_pipeline.dev.workload import run_workload
from es_pipeline.domain import Domain, Event, Reducer
from es_pipeline.errors import ReducerError
from es_pipeline.lake.delta import tables
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel import dead_letters
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state import forked
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.hooks import no_spark
from es_pipeline_tests.support.lakecheck import extract_all
from es_pipeline_tests.support.roles import StoreDsn


def full_replay(dsn: StoreDsn) -> dict[str, tuple[int, dict[str, Any]]]:
    """State of every stream by folding all its events from Postgres, in version order."""
    out: dict[str, tuple[int, dict[str, Any]]] = {}
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT stream_id, stream_type, version, event_type, payload FROM es.events ORDER BY stream_id, version"
        ).fetchall()
    for stream_id, stream_type, version, event_type, payload in rows:
        _, state = out.get(stream_id, (0, {}))
        out[stream_id] = (version, SHOP.reducers[stream_type].fold(state, Event(stream_id, version, event_type, payload)))
    return out


def lake_state(spark: Any, warehouse: Path) -> dict[str, tuple[int, dict[str, Any], int]]:
    rows = tables.read(spark, str(warehouse / "stream_state")).collect()
    return {r["stream_id"]: (r["version"], json.loads(r["state"]), r["revision"]) for r in rows}


@pytest.fixture(params=["spark", "in-process"])
def first_build(request: pytest.FixtureRequest, spark: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`update_stream_state` with its first build on Spark, or in-process (lake/state/whole_fold.py: forked even for a
    few events, and with no Spark session to fall back on)."""
    if request.param == "spark":
        return lambda warehouse, **kw: update_stream_state(Engine(spark=spark, small_increments=False), warehouse, **{"domain": SHOP, **kw})
    monkeypatch.setattr(forked, "ONE_PROCESS_ROWS", 0)
    return lambda warehouse, **kw: update_stream_state(Engine(spark=no_spark), warehouse, **{"domain": SHOP, **kw})


def test_incremental_state_equals_full_replay_after_many_increments_with_concurrent_writers(
    dsn: StoreDsn, spark: Any, warehouse: Path
) -> None:
    run_workload(EventStore(dsn), streams=20, events=100, writers=2, rollback_rate=0, max_commit_delay=0, seed=10)
    extract_all(dsn.extractor, spark, warehouse)
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)  # warm: the Python workers and the table exist
    # 20 s of writers at 60 events/s (their rate, not the size, sets the time): several increments under them.
    writers = threading.Thread(target=run_workload, args=(EventStore(dsn),), kwargs=dict(
        streams=200, events=1200, writers=8, rollback_rate=0.1, max_commit_delay=0.1, seed=11, rate=60.0))
    writers.start()
    increments = 0
    while writers.is_alive():
        extract_all(dsn.extractor, spark, warehouse)
        update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
        increments += 1
    writers.join()
    extract_all(dsn.extractor, spark, warehouse)
    last = update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    assert increments >= 2 and last.previous_events_version > 0, "the state was built incrementally"
    expected = full_replay(dsn)
    got = lake_state(spark, warehouse)
    assert got.keys() == expected.keys()
    for stream_id, (version, state) in expected.items():
        assert got[stream_id][0] == version, stream_id
        assert got[stream_id][1] == json.loads(json.dumps(state)), stream_id


def test_a_retried_update_folds_nothing_twice(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    run_workload(EventStore(dsn), streams=50, events=300, writers=2, rollback_rate=0, max_commit_delay=0)
    extract_all(dsn.extractor, spark, warehouse)
    first = update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    again = update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    assert first.events_folded == 300 and again.events_folded == 0
    assert {k: v[0] for k, v in lake_state(spark, warehouse).items()} == {k: v[0] for k, v in full_replay(dsn).items()}


def test_a_revision_bump_rebuilds_that_stream_type_alone(
    dsn: StoreDsn, spark: Any, warehouse: Path
) -> None:
    run_workload(EventStore(dsn), streams=60, events=400, writers=2, rollback_rate=0, max_commit_delay=0)
    extract_all(dsn.extractor, spark, warehouse)
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    before = {r["stream_id"]: r["updated_at"] for r in tables.read(spark, str(warehouse / "stream_state")).collect()}

    def cart_v2(state: dict[str, Any], event: Event) -> dict[str, Any]:
        return {**SHOP.reducers["cart"].fold(state, event), "events_seen": int(state.get("events_seen", 0)) + 1}

    v2 = Domain("shop v2")
    v2.add(Reducer("cart", 2, cart_v2))
    v2.add(SHOP.reducers["account"])
    for upcaster in SHOP.upcasters.values():  # the shop's, kept: cart's revision is then 3 (2 + its one upcaster)
        v2.add_upcaster(upcaster)
    result = update_stream_state(Engine(spark=spark), warehouse, domain=v2)
    assert result.listed("rebuilt_types") == ("cart",)
    rows = {r["stream_id"]: r for r in tables.read(spark, str(warehouse / "stream_state")).collect()}
    carts = [r for r in rows.values() if r["stream_type"] == "cart"]
    accounts = [r for r in rows.values() if r["stream_type"] == "account"]
    assert carts and accounts
    wrong = [(r["stream_id"], r["revision"], r["version"], r["state"][:80]) for r in carts
             if r["revision"] != 3 or json.loads(r["state"]).get("events_seen") != r["version"]]
    assert not wrong, wrong[:3]
    touched = [r["stream_id"] for r in accounts if r["revision"] != 1 or r["updated_at"] != before[r["stream_id"]]]
    assert not touched, touched[:3]


def test_an_unknown_event_type_quarantines_its_stream_or_with_stop_fails_and_commits_nothing(
    dsn: StoreDsn, spark: Any, warehouse: Path, first_build: Any
) -> None:
    store = EventStore(dsn)
    store.append("cart-ok", "cart", [NewEvent("ItemAdded", {"sku": "a", "qty": 1})], 0)
    store.append("cart-bad", "cart", [NewEvent("ItemAdded", {"sku": "a", "qty": 2}), NewEvent("Teleported", {}),
                                      NewEvent("ItemAdded", {"sku": "b", "qty": 1})], 0)
    extract_all(dsn.extractor, spark, warehouse)
    with pytest.raises(ReducerError, match=r"'cart-bad' version 2 \(Teleported\)"):
        first_build(warehouse, domain=SHOP.folding("stop"))
    state = str(warehouse / "stream_state")
    assert not tables.is_delta_table(state) or tables.read(spark, state).count() == 0

    result = first_build(warehouse)  # quarantine, the default: cart-bad held at version 1, cart-ok folded
    assert result.figures["quarantined_streams"] == 1 and result.figures["streams_updated"] == 2
    rows = {r["stream_id"]: r for r in tables.read(spark, state).collect()}
    expected = full_replay_until(dsn, "cart-bad", 1)
    assert (rows["cart-bad"]["version"], json.loads(rows["cart-bad"]["state"])) == (1, expected)
    held = json.loads(rows["cart-bad"]["quarantined"])
    assert (held["version"], held["event_type"], held["kind"], held["retries"]) == (2, "Teleported",
                                                                                      "UnknownEventType", 0)
    assert [p["version"] for p in json.loads(rows["cart-bad"]["parked"])] == [2, 3]
    assert rows["cart-ok"]["quarantined"] is None and rows["cart-ok"]["version"] == 1
    [letter] = dead_letters.rows_of(warehouse).to_pylist()
    assert (letter["table_name"], letter["key"], letter["version"], letter["event_type"], letter["error_kind"]) == (
        "stream_state", "cart-bad", 2, "Teleported", "UnknownEventType")

    tables.remove_folder(warehouse / "stream_state")
    result = first_build(warehouse, skip_unknown=True)
    assert result.figures["skipped_unknown_events"] == 1 and result.figures["streams_updated"] == 2
    assert result.figures["quarantined_streams"] == 0


def full_replay_until(dsn: StoreDsn, stream_id: str, version: int) -> dict[str, Any]:
    """The state of `stream_id` folded from the store's events up to `version`."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT stream_type, version, event_type, payload FROM es.events WHERE stream_id = %s "
                            "AND version <= %s ORDER BY version", (stream_id, version)).fetchall()
    state: dict[str, Any] = {}
    for stream_type, v, event_type, payload in rows:
        state = SHOP.reducers[stream_type].fold(state, Event(stream_id, v, event_type, payload))
    return json.loads(json.dumps(state))


def test_a_payload_missing_a_field_fails_naming_the_field(
    dsn: StoreDsn, spark: Any, warehouse: Path, first_build: Any
) -> None:
    EventStore(dsn).append("acc-x", "account", [NewEvent("Opened", {"owner": "o", "currency": "EUR"}),
                                                 NewEvent("Deposited", {"amt": 5})], 0)
    extract_all(dsn.extractor, spark, warehouse)
    with pytest.raises(ReducerError, match=r"'acc-x' version 2 \(Deposited\).*no field 'amount'"):
        first_build(warehouse, domain=SHOP.folding("stop"))
    first_build(warehouse)
    [letter] = dead_letters.rows_of(warehouse).to_pylist()
    assert (letter["key"], letter["version"], letter["error_kind"]) == ("acc-x", 2, "KeyError")
    assert "no field 'amount'" in letter["message"]


def test_versions_arriving_out_of_order_wait_for_the_gap_to_fill(spark: Any, warehouse: Path, first_build: Any) -> None:
    """v2 can reach the lake before v1 (xid order differs from commit order): v2 waits, parked."""

    path = str(warehouse / "events")
    tables.ensure_table(spark, path, EVENTS.ddl, properties=EVENTS.properties)

    def put(version: int, event_type: str, payload: dict[str, Any]) -> None:
        spark.createDataFrame(
            [(version, 1, "acc-g", "account", version, 1, event_type, json.dumps(payload), "{}", None, None, 1, "json", "")],
            EVENTS.ddl,
        ).write.format("delta").mode("append").save(path)

    put(1, "Opened", {"owner": "o", "currency": "EUR"})
    put(3, "Withdrawn", {"amount": 2})
    first = first_build(warehouse)
    assert first.figures["parked_streams"] == 1
    assert lake_state(spark, warehouse)["acc-g"][0] == 1
    put(2, "Deposited", {"amount": 10})
    second = update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    assert second.figures["parked_streams"] == 0
    version, state, _ = lake_state(spark, warehouse)["acc-g"]
    assert version == 3 and state["balance"] == 8.0




@pytest.mark.parametrize("small", [False, True], ids=["spark", "arrow"])
def test_two_tenants_with_one_stream_id_keep_their_own_state_and_counts(spark: Any, warehouse: Path, small: bool) -> None:
    """A stream id used by two tenants is two streams: stream_state, stream_catalog and event_type_daily are keyed
    by (tenant, …), on the Spark fold and on the Arrow one; rows written before tenants (NULL) are no tenant ('')."""
    from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog

    path = str(warehouse / "events")
    tables.ensure_table(spark, path, EVENTS.ddl, properties=EVENTS.properties)

    def put(tenant: str | None, version: int, event_type: str, payload: dict[str, Any]) -> None:
        spark.createDataFrame(
            [(version, 1, "acc-1", "account", version, 1, event_type, json.dumps(payload), "{}", None, None, 1,
              "json", tenant)], EVENTS.ddl,
        ).write.format("delta").mode("append").save(path)

    put("a", 1, "Opened", {"owner": "a", "currency": "EUR"})
    put("b", 1, "Opened", {"owner": "b", "currency": "USD"})
    put(None, 1, "Opened", {"owner": "none", "currency": "CHF"})
    update_stream_state(Engine(spark=spark, small_increments=False), warehouse, domain=SHOP)  # the first build is Spark's
    for update in (update_stream_catalog, update_event_type_daily):
        update(Engine(spark=spark, small_increments=False), warehouse)
    put("a", 2, "Deposited", {"amount": 10})
    put("b", 2, "Deposited", {"amount": 5})
    put("b", 3, "Deposited", {"amount": 1})
    assert update_stream_state(Engine(spark=spark, small_increments=small), warehouse, domain=SHOP).events_folded == 3
    update_stream_catalog(Engine(spark=spark, small_increments=small), warehouse)
    update_event_type_daily(Engine(spark=spark, small_increments=small), warehouse)

    state = {r["tenant"]: (r["version"], json.loads(r["state"])) for r in tables.read(spark, str(warehouse / "stream_state")).collect()}
    assert {t: (v, s["owner"], s["balance"]) for t, (v, s) in state.items()} == {
        "a": (2, "a", 10.0), "b": (3, "b", 6.0), "": (1, "none", 0.0)}
    catalog = {(r["tenant"], r["stream_id"]): (r["version"], r["events"])
               for r in tables.read(spark, str(warehouse / "stream_catalog")).collect()}
    assert catalog == {("a", "acc-1"): (2, 2), ("b", "acc-1"): (3, 3), ("", "acc-1"): (1, 1)}
    daily = {(r["tenant"], r["event_type"]): r["events"] for r in tables.read(spark, str(warehouse / "event_type_daily")).collect()}
    assert daily == {("a", "Opened"): 1, ("a", "Deposited"): 1, ("b", "Opened"): 1, ("b", "Deposited"): 2, ("", "Opened"): 1}


def test_a_stream_state_made_before_tenants_takes_the_column_and_keeps_its_rows(spark: Any, warehouse: Path) -> None:
    """An older release's stream_state (no `tenant`) is migrated by the next update: its rows become tenant ''
    and are folded on, not duplicated."""
    path = str(warehouse / "events")
    tables.ensure_table(spark, path, EVENTS.ddl, properties=EVENTS.properties)
    spark.createDataFrame([(1, 1, "acc-o", "account", 1, 1, "Opened", json.dumps({"owner": "o", "currency": "EUR"}),
                            "{}", None, None, 1, None, None)], EVENTS.ddl).write.format("delta").mode("append").save(path)
    update_stream_state(Engine(spark=spark, small_increments=False), warehouse, domain=SHOP)
    state_path = str(warehouse / "stream_state")
    old = tables.read(spark, state_path).drop("tenant")  # what a release before tenants left
    old.write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(state_path)
    assert not tables.has_columns(state_path, ["tenant"])
    spark.createDataFrame([(2, 2, "acc-o", "account", 2, 1, "Deposited", json.dumps({"amount": 3}), "{}", None, None, 2,
                            "json", "")], EVENTS.ddl).write.format("delta").mode("append").save(path)
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    rows = tables.read(spark, state_path).collect()
    assert [(r["tenant"], r["stream_id"], r["version"], json.loads(r["state"])["balance"]) for r in rows] == [
        ("", "acc-o", 2, 3.0)]


def _invoice_domain() -> Domain:
    """A second team's domain: invoices, which the shop has no reducer for."""
    billing = Domain("billing")

    @billing.reducer("invoice", revision=1)
    def invoice(state: dict[str, Any], event: Event) -> dict[str, Any]:
        if event.event_type == "Issued":
            return {"amount": event.payload["amount"], "paid": False}
        return {**state, "paid": True}

    return Domain.merged([SHOP, billing])


def test_a_stream_type_without_a_reducer_has_rows_without_state_until_a_reducer_folds_it_from_the_start(
    dsn: StoreDsn, spark: Any, warehouse: Path, first_build: Any
) -> None:
    store = EventStore(dsn)
    store.append("inv-1", "invoice", [NewEvent("Issued", {"amount": 10}), NewEvent("Paid", {})], 0)
    store.append("inv-2", "invoice", [NewEvent("Issued", {"amount": 5})], 0)
    store.append("cart-1", "cart", [NewEvent("ItemAdded", {"sku": "a", "unit_price": 2.0})], 0)
    extract_all(dsn.extractor, spark, warehouse)
    built = first_build(warehouse)
    assert (built.figures["streams_updated"], built.figures["streams_without_reducer"], built.events_folded) == (3, 2, 4)
    path = str(warehouse / "stream_state")

    def rows() -> dict[str, Any]:
        return {r["stream_id"]: r for r in tables.read(spark, path).collect()}

    inv = rows()["inv-1"]
    assert (inv["version"], inv["state"], inv["revision"], inv["stream_type"]) == (2, None, 0, "invoice")
    assert inv["last_event_at"] is not None and rows()["cart-1"]["revision"] == SHOP.revisions()["cart"]
    store.append("inv-2", "invoice", [NewEvent("Paid", {})], 1)
    extract_all(dsn.extractor, spark, warehouse)
    increment = update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)  # the small increment
    assert (increment.events_folded, increment.figures["streams_without_reducer"]) == (1, 1)
    assert (rows()["inv-2"]["version"], rows()["inv-2"]["state"]) == (2, None)
    cart_at = rows()["cart-1"]["updated_at"]

    added = update_stream_state(Engine(spark=spark), warehouse, domain=_invoice_domain())  # a reducer for invoices: that type, from v1
    assert added.listed("rebuilt_types") == ("invoice",) and added.figures["streams_without_reducer"] == 0
    after = rows()
    assert {s: (after[s]["revision"], json.loads(after[s]["state"])) for s in ("inv-1", "inv-2")} == {
        "inv-1": (1, {"amount": 10, "paid": True}), "inv-2": (1, {"amount": 5, "paid": True})}
    assert after["cart-1"]["updated_at"] == cart_at
    removed = update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)  # the reducer gone again: its streams back to rows without state
    assert removed.listed("rebuilt_types") == ("invoice",)
    assert {(r["stream_id"], r["state"], r["revision"]) for r in rows().values() if r["stream_type"] == "invoice"} == {
        ("inv-1", None, 0), ("inv-2", None, 0)}
