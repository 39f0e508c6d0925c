"""A poisoned event quarantines its stream, never the lake (docs/decisions/0051), on the small increments in this
process and on Spark: under concurrent writers, every other stream's state, typed row and history equal a fold of
the store computed here; the poisoned stream holds its last good state and says so; its `_dead_letters` row is
there; a new revision that handles the event makes the stream the store's fold and takes the row away. The
expected values come from the store (`es.events` and the reducers), never from the lake."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.dev.workload import run_workload
from es_pipeline.domain import Domain, Event, Reducer, State
from es_pipeline.lake.kernel import dead_letters
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state.snapshots import take_snapshots
from es_pipeline.lake.state.stream_state import retry, update_stream_state, versions_off
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.hooks import no_spark
from es_pipeline_tests.support.lakecheck import extract_all
from es_pipeline_tests.support.roles import StoreDsn

POISONED = "cart-poisoned"
CLI = str(Path(sys.executable).parent / "es-pipeline")


def _cart_v1(state: State, event: Event) -> State:
    if event.event_type == "CardCharged":
        raise ValueError(f"cannot charge card {event.payload['card']}")  # the team's message quotes the payload
    return SHOP.reducers["cart"].fold(state, event)


def _cart_v2(state: State, event: Event) -> State:
    return {**state, "status": "charged"} if event.event_type == "CardCharged" else SHOP.reducers["cart"].fold(
        state, event)


def _domain(revision: int) -> Domain:
    cart = SHOP.reducers["cart"]
    out = Domain(f"shop, cart v{revision}")
    out.add(Reducer("cart", revision, _cart_v1 if revision == 1 else _cart_v2, out.name, cart.state, cart.history))
    out.add(SHOP.reducers["account"])
    for upcaster in SHOP.upcasters.values():
        out.add_upcaster(upcaster)
    return out


def _store_fold(dsn: StoreDsn, domain: Domain, *, until: dict[str, int] | None = None
                ) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """Every stream's states after each of its events, folded here from the store (up to `until`'s version)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT stream_id, stream_type, version, event_type, payload FROM es.events "
                            "ORDER BY stream_id, version").fetchall()
    out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for stream_id, stream_type, version, event_type, payload in rows:
        if until and version > until.get(stream_id, version):
            continue
        trail = out.setdefault(stream_id, [])
        state = trail[-1][1] if trail else {}
        state = domain.folds[stream_type].fold(dict(state), Event(stream_id, version, event_type, payload))
        trail.append((version, json.loads(json.dumps(state))))
    return out


def _table(warehouse: Path, name: str) -> list[dict[str, Any]]:
    return DeltaTable(str(warehouse / name)).to_pyarrow_table().to_pylist()


def _assert_lake_is(warehouse: Path, expected: dict[str, list[tuple[int, dict[str, Any]]]]) -> None:
    """stream_state, the carts' typed rows and their history (a row per event: grain "each") equal `expected`."""
    state = {r["stream_id"]: r for r in _table(warehouse, "stream_state")}
    assert state.keys() == expected.keys()
    wrong = [s for s, trail in expected.items()
             if (state[s]["version"], json.loads(state[s]["state"])) != trail[-1]]
    assert not wrong, wrong[:5]
    carts = {s for s, r in state.items() if r["stream_type"] == "cart"}
    typed = {r["stream_id"]: r for r in _table(warehouse, "stream_state_cart")}
    assert typed.keys() == carts
    wrong = [s for s in carts if (typed[s]["version"], typed[s]["status"], typed[s]["total"]) != (
        expected[s][-1][0], expected[s][-1][1].get("status"), expected[s][-1][1].get("total"))]
    assert not wrong, wrong[:5]
    history = {(r["stream_id"], r["version_from"]): json.loads(r["state"])
               for r in _table(warehouse, "stream_state_cart_history")}
    assert history == {(s, v): st for s in carts for v, st in expected[s]}


@pytest.mark.parametrize("engine", ["in-process", "spark"])
def test_a_poisoned_event_quarantines_its_stream_alone_and_a_new_revision_refolds_it_exactly(
    engine: str, dsn: StoreDsn, spark: Any, warehouse: Path
) -> None:
    on = Engine(spark=no_spark) if engine == "in-process" else Engine(spark=spark, small_increments=False)
    streams, events = (1500, 4500) if engine == "in-process" else (300, 900)
    store = EventStore(dsn)
    run_workload(store, streams=streams, events=events // 3, writers=2, rollback_rate=0, max_commit_delay=0, seed=5)
    store.append(POISONED, "cart", [NewEvent("ItemAdded", {"sku": "a", "qty": 2})], 0)
    extract_all(dsn.extractor, spark, warehouse)
    update_stream_state(on, warehouse, domain=_domain(1))

    # Writers go on (rollbacks, out-of-order commits) while the poisoned event and the events after it arrive, and
    # the lake is updated under them.
    writers = threading.Thread(target=run_workload, args=(EventStore(dsn),), kwargs=dict(
        streams=streams, events=events * 2 // 3, writers=4, rollback_rate=0.1, max_commit_delay=0.05, seed=6,
        rate=400.0 if engine == "in-process" else 100.0))
    writers.start()
    store.append(POISONED, "cart", [NewEvent("ItemAdded", {"sku": "b", "qty": 1}),
                                    NewEvent("CardCharged", {"card": "4111-1111-1111-1111"}),
                                    NewEvent("ItemAdded", {"sku": "c", "qty": 1})], 1)
    said = []  # each update's count of quarantined streams (every update that folds refolds them)
    while writers.is_alive() or len(said) < 2:
        extract_all(dsn.extractor, spark, warehouse)
        said.append(update_stream_state(on, warehouse, domain=_domain(1)).figures["quarantined_streams"])
    writers.join()
    extract_all(dsn.extractor, spark, warehouse)
    said.append(update_stream_state(on, warehouse, domain=_domain(1)).figures["quarantined_streams"])
    # One more update with a new event, whenever the poisoned one reached the lake: it retries the held stream.
    store.append("cart-after", "cart", [NewEvent("ItemAdded", {"sku": "z", "qty": 1})], 0)
    extract_all(dsn.extractor, spark, warehouse)
    said.append(update_stream_state(on, warehouse, domain=_domain(1)).figures["quarantined_streams"])
    assert set(said) <= {0, 1} and 1 in said, said

    # Every other stream is the store's fold; the poisoned one its fold up to the event before (version 2).
    _assert_lake_is(warehouse, _store_fold(dsn, _domain(1), until={POISONED: 2}))
    row = next(r for r in _table(warehouse, "stream_state") if r["stream_id"] == POISONED)
    held = json.loads(row["quarantined"])
    assert (held["version"], held["event_type"], held["kind"]) == (3, "CardCharged", "ValueError")
    assert held["retries"] >= 1, "each update retried it with the code deployed"
    assert [p["version"] for p in json.loads(row["parked"])] == [3, 4]
    assert [r["stream_id"] for r in _table(warehouse, "stream_state") if r["quarantined"]] == [POISONED]
    assert [r["stream_id"] for r in _table(warehouse, "stream_state_cart") if r["quarantined"]] == [POISONED], \
        "its typed row says so too"
    [letter] = dead_letters.rows_of(warehouse).to_pylist()
    assert (letter["table_name"], letter["key"], letter["version"], letter["event_type"], letter["error_kind"]) == (
        "stream_state", POISONED, 3, "CardCharged", "ValueError")
    assert "4111-1111-1111-1111" in letter["message"], "the team's message stays in the lake"
    off = versions_off(warehouse, on)
    assert (off.streams, off.quarantined) == (0, 1), "the check passes on every other stream and counts it"
    if engine == "in-process":  # an analyst's `state_as_of` says which stream's history stops short, now
        from es_pipeline.lake.read import query

        now = query.run(warehouse, "SELECT stream_id, quarantined FROM state_as_of('cart', now()) "
                                   "WHERE quarantined IS NOT NULL").rows.to_pylist()
        assert [r["stream_id"] for r in now] == [POISONED] and json.loads(now[0]["quarantined"])["version"] == 3
        # the operator's list, from the command line
        listed = subprocess.run([CLI, "lake", "quarantined"], env={**os.environ, "ES_PIPELINE_WAREHOUSE": str(warehouse)},
                              capture_output=True, text=True, timeout=120, check=True).stdout
        assert "1 quarantined" in listed and f"stream_state '{POISONED}' (cart) at version 3 (CardCharged): " \
            "ValueError" in listed, listed
    take_snapshots(on, warehouse, EventStore(dsn.snapshots), threshold=1)
    snapped = {r["stream_id"] for r in _table(warehouse, "snapshots")}
    assert POISONED not in snapped and len(snapped) >= streams // 2, "no snapshot of a quarantined stream"

    # A revision that handles the event: the cart type rebuilt beside and swapped in; the stream is the store's fold.
    rebuilt = update_stream_state(on, warehouse, domain=_domain(2))
    assert rebuilt.listed("rebuilt_types") == ("cart",)
    _assert_lake_is(warehouse, _store_fold(dsn, _domain(2)))
    assert not [r for r in _table(warehouse, "stream_state") if r["quarantined"] or r["parked"]]
    assert dead_letters.rows_of(warehouse).num_rows == 0, "its dead letter gone with the swap"


_FLAKY = """
from pathlib import Path

import shop.domain as shop

from es_pipeline.domain import Domain

domain = Domain("flaky shop")
domain.add(shop.domain.reducers["account"])
for upcaster in shop.domain.upcasters.values():
    domain.add_upcaster(upcaster)
BLOCKER = Path(__file__).with_name("processor-down")


@domain.reducer("cart", revision=1, state=shop.domain.reducers["cart"].state, history=True)
def cart(state, event):
    if event.event_type == "CardCharged":
        if BLOCKER.exists():
            raise OSError("the card processor's rates file is missing")
        return {**state, "status": "charged"}
    return shop.domain.reducers["cart"].fold(state, event)
"""


def test_a_transient_failure_clears_at_a_retry_with_no_new_events(dsn: StoreDsn, warehouse: Path,
                                                                  tmp_path: Path) -> None:
    """A cause outside the code (here a file whose presence fails the reducer): `lake retry` refolds the held stream
    with the code as deployed, with no new event to fold; while the cause stays it counts the retry and exits 1; once
    gone the stream is the store's fold and leaves `_dead_letters` in the same update."""
    (tmp_path / "flaky_shop.py").write_text(_FLAKY)
    (tmp_path / "processor-down").touch()
    sys.path.insert(0, str(tmp_path))
    try:
        from flaky_shop import domain  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
    store = EventStore(dsn)
    run_workload(store, streams=40, events=150, writers=2, rollback_rate=0, max_commit_delay=0, seed=7)
    store.append(POISONED, "cart", [NewEvent("ItemAdded", {"sku": "a", "qty": 2}),
                                    NewEvent("CardCharged", {"card": "5500-0000-0000-0004"}),
                                    NewEvent("ItemAdded", {"sku": "b", "qty": 1})], 0)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=no_spark), warehouse, domain=domain, store_dsn=dsn.extractor)
    assert dead_letters.counts(warehouse) == {"stream_state": 1}

    again = retry(warehouse, domain, streams=[POISONED], store_dsn=dsn.extractor)
    assert again is not None and again.figures["quarantined_streams"] == 1
    [letter] = dead_letters.rows_of(warehouse).to_pylist()
    assert (letter["version"], letter["error_kind"], letter["retries"]) == (2, "OSError", 1)

    env = {**os.environ, "ES_PIPELINE_WAREHOUSE": str(warehouse), "ES_PIPELINE_PG_DSN": dsn.extractor,
           "ES_PIPELINE_DOMAIN": "flaky_shop", "PYTHONPATH": str(tmp_path), "ES_PIPELINE_ENGINE": "local"}
    held = subprocess.run([CLI, "lake", "retry"], env=env, capture_output=True, text=True, timeout=120)
    assert held.returncode == 1 and "quarantined in stream_state: 1 listed before, 1 held now" in held.stdout, \
        held.stdout + held.stderr
    (tmp_path / "processor-down").unlink()  # the cause gone
    cleared = subprocess.run([CLI, "lake", "retry", "stream_state", "--stream", POISONED], env=env,
                             capture_output=True, text=True, timeout=120)
    assert cleared.returncode == 0 and "1 listed before, 0 held now" in cleared.stdout, cleared.stdout + cleared.stderr
    _assert_lake_is(warehouse, _store_fold(dsn, domain))
    assert dead_letters.rows_of(warehouse).num_rows == 0
    assert not [r for r in _table(warehouse, "stream_state") if r["quarantined"] or r["parked"]]


def _ledger(revision: int, fold_errors: str = "quarantine") -> Domain:
    """A cross-stream projection of `Moved` events by account: revision 1 cannot take an amount of 666; its key
    function cannot read an account of "?"."""
    d = Domain(f"ledger v{revision}", fold_errors=fold_errors)

    def account_of(event: Event) -> str | None:
        if event.payload.get("account") == "?":
            raise ValueError("an account of '?'")
        return event.payload.get("account")

    @d.projection("balances", events=["Moved"], key=account_of, key_column="account", revision=revision)
    def balances(state: State, event: Event) -> State:
        if revision == 1 and event.payload["amount"] == 666:
            raise ValueError(f"cursed amount on {event.payload['account']}")
        return {"balance": state.get("balance", 0) + event.payload["amount"]}

    return d


def _balances(dsn: StoreDsn, until: dict[str, tuple[str, int]] | None = None) -> dict[str, int]:
    """Each account's balance from the store (every key's events once; `until`: an account's events before that
    stream's version only)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT stream_id, version, payload FROM es.events WHERE event_type = 'Moved'").fetchall()
    out: dict[str, int] = {}
    for stream_id, version, payload in rows:
        account = payload.get("account")
        if account in (None, "?"):
            continue
        stop = (until or {}).get(account)
        if stop is not None and (stream_id, version) >= stop:
            continue
        out[account] = out.get(account, 0) + payload["amount"]
    return out


def test_a_cross_stream_key_is_quarantined_alone_and_a_key_that_cannot_be_read_goes_to_the_dead_letters(
    dsn: StoreDsn, warehouse: Path
) -> None:
    from es_pipeline.errors import ProjectionFoldError
    from es_pipeline.lake import cross_stream

    store = EventStore(dsn)
    for i in range(40):
        store.append(f"t-{i}", "transfer", [NewEvent("Moved", {"account": f"a{i % 8}", "amount": i + 1})], 0)
    extract_all(dsn.extractor, None, warehouse)
    cross_stream.update(warehouse, _ledger(1), "balances")
    store.append("t-bad", "transfer", [NewEvent("Moved", {"account": "a3", "amount": 666}),
                                       NewEvent("Moved", {"account": "a3", "amount": 5})], 0)
    store.append("t-note", "transfer", [NewEvent("Moved", {"account": "?", "amount": 1})], 0)
    store.append("t-more", "transfer", [NewEvent("Moved", {"account": "a5", "amount": 2})], 0)
    extract_all(dsn.extractor, None, warehouse)
    with pytest.raises(ProjectionFoldError, match="'balances' failed on stream 't-note' version 1 \\(Moved\\): its key"):
        cross_stream.update(warehouse, _ledger(1, "stop"), "balances")

    done = cross_stream.update(warehouse, _ledger(1), "balances")  # the increment, under quarantine
    assert (done.figures["keys_quarantined"], done.figures["events_key_failed"]) == (1, 1)
    rows = {r["account"]: r for r in _table(warehouse, "balances")}
    expected = _balances(dsn, until={"a3": ("t-bad", 1)})
    assert {a: json.loads(r["state"])["balance"] for a, r in rows.items()} == expected, "a3 at its last good state"
    held = json.loads(rows["a3"]["quarantined"])
    assert (held["stream_id"], held["version"], held["kind"]) == ("t-bad", 1, "ValueError")
    assert [(p["stream_id"], p["version"]) for p in json.loads(rows["a3"]["parked"])] == [("t-bad", 1), ("t-bad", 2)]
    assert [a for a, r in rows.items() if r["quarantined"]] == ["a3"]
    letters = {(r["key"], r["stream_id"], r["version"], r["error_kind"]) for r in
               dead_letters.rows_of(warehouse, "balances").to_pylist()}
    assert letters == {("a3", "t-bad", 1, "ValueError"), (None, "t-note", 1, "ValueError")}

    store.append("t-later", "transfer", [NewEvent("Moved", {"account": "a3", "amount": 9})], 0)
    extract_all(dsn.extractor, None, warehouse)
    again = cross_stream.update(warehouse, _ledger(1), "balances")  # a3 tried again with its new event: still held
    assert again.figures["keys_quarantined"] == 1
    row = {r["account"]: r for r in _table(warehouse, "balances")}["a3"]
    assert json.loads(row["quarantined"])["retries"] == 1 and len(json.loads(row["parked"])) == 3
    assert dead_letters.counts(warehouse) == {"balances": 1}, "the held key"
    assert dead_letters.counts(warehouse, keyless=True) == {"balances": 1}, "the key-less event stays listed"
    from es_pipeline.extraction.rebuild import rebuildable
    from es_pipeline.lake import inventory

    assert inventory.lake_tables(warehouse)[-1] == "_dead_letters", "erased, compacted and named like every table"
    assert "_dead_letters" not in rebuildable(warehouse), "no projection: `lake rebuild` does not take it"
    check = cross_stream.reconcile(warehouse, _ledger(1), "balances")
    assert check.keys_off == 0, "the check leaves the held key out (its quarantine has its own alert)"
    retried = cross_stream.retry(warehouse, _ledger(1), "balances")  # no new event: the held key alone, again
    assert retried is not None and retried.figures["keys_quarantined"] == 1 and retried.events_folded == 3
    row = {r["account"]: r for r in _table(warehouse, "balances")}["a3"]
    assert json.loads(row["quarantined"])["retries"] == 2

    fixed = cross_stream.update(warehouse, _ledger(2), "balances")  # a new revision: every key folded again
    rows = {r["account"]: r for r in _table(warehouse, "balances")}
    assert {a: json.loads(r["state"])["balance"] for a, r in rows.items()} == _balances(dsn)
    assert not [a for a, r in rows.items() if r["quarantined"] or r["parked"]] and fixed.figures["keys_quarantined"] == 0
    assert [(r["key"], r["stream_id"]) for r in dead_letters.rows_of(warehouse, "balances").to_pylist()] == [
        (None, "t-note")], "the key function still cannot read it: listed again by the build"
