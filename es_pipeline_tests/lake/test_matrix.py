"""Every projection kind through generated histories of operations: appends of carts (history of every state) and
accounts (daily history), extractions of some ranges (so that batches land out of commit order), updates of some
projections, a reducer and projection revision or an upcaster added (rebuilds) and back, two updates of one table
racing, a tailing run's follows beside a rebuild's swap, and updates that crash at one of their Delta commits (an
append, a merge, a table's creation, a restore, a property change), before or after it. Each history ends with
every table equal to a fold of the **store** computed here.

The order a cross-stream projection folds in (docs/domain.md, "The order of events") is modelled from what the
test did, never read from the lake: each extraction of a range takes, as one batch, the events of its slices
below the watermarks the store's offsets hold after it, so that events sort by (the extraction that took them,
their position). Writes are one at a time, so position is commit order within a batch.

The moves of the store (restore and rebase, a second move) are in lake/test_order_across_moves.py and
extraction/test_history.py; the lake rebuilt as the docs say in lake/test_built_from.py; tenant erasure in
extraction/test_tenant_erase.py; an update whose position another committed meanwhile in lake/test_serial.py."""

from __future__ import annotations

import contextlib
import copy
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import deltalake
import psycopg
import pytest
from deltalake import DeltaTable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shop.domain import domain as SHOP

from es_pipeline.domain import Domain, Event, Upcaster
from es_pipeline.errors import NoEventsYet
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.offsets import batch_frontier, read_watermarks
from es_pipeline.extraction.slices import split
from es_pipeline.lake import cross_stream
from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog
from es_pipeline.lake.follow import follow
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state import history as state_history
from es_pipeline.lake.state import rebuild, stream_state, typed_state
from es_pipeline.lake.typed import event_tables
from es_pipeline.source import mapping
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.lake.test_history import expected_rows, lake_rows
from es_pipeline_tests.support.projections import rows_of
from es_pipeline_tests.support.roles import StoreDsn

CONSUMER = mapping.load(None, "es").consumer
PROJECTIONS = ("stream_state", "stream_catalog", "event_type_daily", "sku_sales", "event_tables")
LAKE_MODULES = (cross_stream, event_tables, stream_state, typed_state, state_history, rebuild)  # where `write_deltalake` is imported by name


def _revised(domain: Domain) -> Domain:
    """The same folds under revisions one higher: every table built from them is rebuilt."""
    out = copy.copy(domain)
    out.reducers = {t: replace(r, revision=r.revision + 1) for t, r in domain.reducers.items()}
    out.projections = {n: replace(p, revision=p.revision + 1) for n, p in domain.projections.items()}
    return out


def _with_an_upcaster(domain: Domain) -> Domain:
    """The same domain with one more upcaster (of ItemRemoved, leaving its payload as it is): the tables of its
    types are rebuilt, to the same values."""
    out = copy.copy(domain)
    out.upcasters, out._folds, out._chains = dict(domain.upcasters), None, {}
    out.add_upcaster(Upcaster("ItemRemoved", 1, lambda payload: payload, ("cart",)))
    return out


DOMAINS = {"shop": SHOP, "revised": _revised(SHOP), "upcast": _with_an_upcaster(SHOP)}

# One event of a cart: (cart, kind, sku, qty, price); of an account: (account, kind, amount).
EVENTS = st.tuples(st.integers(0, 4), st.sampled_from(["ItemAdded", "ItemAdded", "ItemRemoved"]),
                   st.sampled_from(["A", "B", "C"]), st.integers(1, 3), st.sampled_from([1.0, 2.5, 4.0]))
ACCOUNT_EVENTS = st.tuples(st.integers(0, 2), st.sampled_from(["Deposited", "Deposited", "Withdrawn"]),
                           st.sampled_from([1.25, 10.0, 40.5]))
OPERATIONS = st.one_of(
    st.tuples(st.just("append"), st.lists(EVENTS, min_size=1, max_size=6)),
    st.tuples(st.just("append_accounts"), st.lists(ACCOUNT_EVENTS, min_size=1, max_size=4)),
    st.tuples(st.just("extract"), st.sampled_from([1, 2, 4]), st.integers(1, 15)),  # ranges of split(n), by bits
    st.tuples(st.just("update"), st.sets(st.sampled_from(PROJECTIONS), min_size=1), st.sampled_from(sorted(DOMAINS))),
    st.tuples(st.just("race"), st.sampled_from(PROJECTIONS)),  # two updates of one table at once
    st.tuples(st.just("crash"), st.sampled_from(PROJECTIONS), st.integers(0, 2), st.booleans()),  # k-th commit, after?
    # A revision's rebuild beside stream_state (lake/state/rebuild.py) in three pieces, crashing at its k-th commit
    # (the live increment's, the shadow's start, pieces, catch-up, the swap's): resumed, or started again under
    # another revision, by a later update.
    st.tuples(st.just("rebuild_crash"), st.sampled_from(sorted(DOMAINS)), st.integers(0, 11), st.booleans()),
    st.tuples(st.just("tail"), st.sampled_from(sorted(DOMAINS))),  # a tailing run's increments (a type held back)
    st.tuples(st.just("tail_beside_swap"), st.sampled_from(sorted(DOMAINS))),  # follows while a rebuild swaps in
)


class Crash(Exception):
    """The update's process died at a Delta commit."""


@contextlib.contextmanager
def _crash_at(k: int, after: bool) -> Iterator[None]:
    """Every Delta commit delta-rs makes meanwhile counted; the k-th (from 0) raises `Crash`, before it lands or
    just after."""
    seen = [0]

    def counted(commit: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            n, seen[0] = seen[0], seen[0] + 1
            if n == k and not after:
                raise Crash(f"before commit {k}")
            out = commit(*args, **kwargs)
            if n == k:
                raise Crash(f"after commit {k}")
            return out
        return run

    with pytest.MonkeyPatch.context() as m:
        m.setattr(deltalake.table.TableMerger, "execute", counted(deltalake.table.TableMerger.execute))
        m.setattr(DeltaTable, "create_write_transaction", counted(DeltaTable.create_write_transaction))
        m.setattr(DeltaTable, "restore", counted(DeltaTable.restore))
        m.setattr(DeltaTable, "create", classmethod(counted(DeltaTable.create.__func__)))  # type: ignore[attr-defined]
        m.setattr(deltalake.table.TableAlterer, "set_table_properties",
                  counted(deltalake.table.TableAlterer.set_table_properties))
        for module in LAKE_MODULES:
            if hasattr(module, "write_deltalake"):
                m.setattr(module, "write_deltalake", counted(module.write_deltalake))
        yield


class History:
    """One generated history against its own store and lake, with the model of the order it implies."""

    def __init__(self, dsn: StoreDsn, warehouse: Path, spark: Any) -> None:
        self.dsn, self.warehouse, self.spark = dsn, warehouse, spark
        self.store = EventStore(dsn.writer)
        self.versions: dict[str, int] = {}
        self.extraction = 0
        self.taken_by: dict[tuple[str, int], int] = {}  # (stream, version) → the extraction that took it

    def append(self, events: list[tuple[int, str, str, int, float]]) -> None:
        for cart, kind, sku, qty, price in events:
            stream = f"cart-{cart}"
            payload = {"sku": sku, "qty": qty, "unit_price": price} if kind == "ItemAdded" else {"sku": sku}
            self.versions[stream] = self.store.append(stream, "cart", [NewEvent(kind, payload)],
                                                      self.versions.get(stream, 0))

    def append_accounts(self, events: list[tuple[int, str, float]]) -> None:
        for account, kind, amount in events:
            stream = f"account-{account}"
            opened = [] if stream in self.versions else [NewEvent("Opened", {"owner": f"o{account}", "currency": "EUR"})]
            written = [*opened, NewEvent(kind, {"amount": amount})]
            self.versions[stream] = self.store.append(stream, "account", written, self.versions.get(stream, 0))

    def extract(self, n: int, which: int) -> None:
        extractor = Extractor(self.dsn.extractor, None, self.warehouse)
        for i, r in enumerate(split(n)):
            if which >> i & 1:
                extractor.run(r)
                self._taken(list(range(r.lo, r.hi + 1)))

    def _taken(self, slices: list[int]) -> None:
        """The model: the events of these slices below their watermarks now, not taken before, are this batch."""
        self.extraction += 1
        with psycopg.connect(self.dsn) as conn:
            marks = read_watermarks(conn, CONSUMER, slices)
            rows = conn.execute("SELECT stream_id, version, slice, tx_id::text::bigint FROM es.events "
                                "WHERE slice = ANY(%s)", (slices,)).fetchall()
        for stream, version, slice_, tx in rows:
            if (stream, version) not in self.taken_by and tx < marks[slice_]:
                self.taken_by[(stream, version)] = self.extraction

    def update(self, names: set[str] | tuple[str, ...], domain: Domain = SHOP) -> None:
        w, dsn = self.warehouse, self.dsn.extractor
        for name in sorted(names):
            if name == "stream_state":
                stream_state.update_stream_state(Engine(spark=self.spark), w, domain=domain, store_dsn=dsn)
            elif name == "stream_catalog":
                update_stream_catalog(Engine(spark=self.spark), w, store_dsn=dsn)
            elif name == "event_type_daily":
                update_event_type_daily(Engine(spark=self.spark), w, store_dsn=dsn)
            elif name == "sku_sales":
                cross_stream.update(w, domain, name, store_dsn=dsn, frontier=lambda: batch_frontier(dsn, CONSUMER))
            else:
                event_tables.update(w, domain, store_dsn=dsn)

    def race(self, name: str) -> None:
        """Two updates of `name` at once, as two runs would: each waits for the other's turn."""
        failed: list[BaseException] = []

        def one() -> None:
            try:
                self.update({name})
            except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
                failed.append(exc)

        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failed:
            raise failed[0]

    def crash(self, name: str, k: int, after: bool) -> None:
        with contextlib.suppress(Crash), _crash_at(k, after):
            self.update({name})

    def rebuild_crash(self, domain: str, k: int, after: bool) -> None:
        with contextlib.suppress(Crash), _crash_at(k, after), pytest.MonkeyPatch.context() as m:
            m.setattr(rebuild.pieces, "count_for", lambda size: 3)
            self.update({"stream_state"}, DOMAINS[domain])

    def tail(self, domain: str) -> None:
        dsn = self.dsn.extractor
        follow(self.warehouse, dsn, DOMAINS[domain], frontier=lambda: batch_frontier(dsn, CONSUMER))

    def tail_beside_swap(self, domain: str) -> None:
        """A tailing run's follows while `stream_state`'s update rebuilds a type beside it and swaps it in."""
        failed: list[BaseException] = []

        def swapping() -> None:
            try:
                self.update({"stream_state"}, DOMAINS[domain])
            except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
                failed.append(exc)

        thread = threading.Thread(target=swapping)
        thread.start()
        self.tail(domain)  # the run's domain is the update's: one deployment
        while thread.is_alive():
            self.tail(domain)
        thread.join()
        if failed:
            raise failed[0]

    def run(self, operation: tuple[Any, ...]) -> None:
        kind, *args = operation
        if kind == "update":
            names, domain = args
            self.update(names, DOMAINS[domain])
        else:
            getattr(self, kind)(*args)

    def assert_every_table_equals_the_store(self) -> None:
        self.extract(1, 1)  # everything in; then every projection up to it, with today's revisions
        self.update(PROJECTIONS)
        with psycopg.connect(self.dsn) as conn:
            history = conn.execute("SELECT stream_id, version, event_type, payload, global_position, "
                                   "(recorded_at AT TIME ZONE 'UTC')::date, recorded_at FROM es.events "
                                   "ORDER BY stream_id, version").fetchall()
        assert {(s, v) for s, v, *_ in history} == set(self.taken_by), "the model took every event once"
        states: dict[str, tuple[int, dict[str, Any]]] = {}
        trails: dict[tuple[str, int], list[Any]] = {}  # the cart history: every state, from its running max time
        for stream, version, etype, payload, _, _, at in history:
            kind = stream.split("-")[0]
            states[stream] = (version, SHOP.reducers[kind].fold(states.get(stream, (0, {}))[1],
                                                                Event(stream, version, etype, payload)))
            if kind != "cart":
                continue
            before = trails.get((stream, version - 1))
            high = at if before is None or at > before[1] else before[1]
            if before is not None:
                before[2] = high
            trails[(stream, version)] = [version, high, None, json.loads(json.dumps(states[stream][1]))]
        assert {r["stream_id"]: (r["version"], json.loads(r["state"]))
                for r in rows_of(self.warehouse, "stream_state")} == states
        assert rebuild.progress(self.warehouse) == [], "every rebuild swapped in, its shadow gone"
        assert {r["stream_id"]: (r["version"], r["total"]) for r in rows_of(self.warehouse, "stream_state_cart")} == \
            {s: (v, state["total"]) for s, (v, state) in states.items() if s.startswith("cart-")}
        if any(s.startswith("account-") for s in states):  # the daily grain: each day's last state, from the store
            assert {r["stream_id"]: (r["version"], r["balance"]) for r in rows_of(self.warehouse, "stream_state_account")} \
                == {s: (v, state["balance"]) for s, (v, state) in states.items() if s.startswith("account-")}
            assert lake_rows(self.warehouse, "account") == expected_rows(self.dsn, SHOP, "account")
        assert {(r["stream_id"], r["version_from"]): [r["version_to"], r["valid_from"], r["valid_to"],
                                                      json.loads(r["state"])]
                for r in rows_of(self.warehouse, "stream_state_cart_history")} == trails
        catalog: dict[str, tuple[int, int]] = {}
        daily: dict[tuple[str, str, Any], int] = {}
        for stream, version, etype, _, _, day, _ in history:
            catalog[stream] = (catalog.get(stream, (0, 0))[0] + 1, max(version, catalog.get(stream, (0, 0))[1]))
            kind = stream.split("-")[0]
            daily[(kind, etype, day)] = daily.get((kind, etype, day), 0) + 1
        assert {r["stream_id"]: (r["events"], r["version"])
                for r in rows_of(self.warehouse, "stream_catalog")} == catalog
        assert {(r["stream_type"], r["event_type"], r["event_date"]): r["events"]
                for r in rows_of(self.warehouse, "event_type_daily")} == daily

        fold = SHOP.projections["sku_sales"].fold
        sales: dict[str, tuple[int, dict[str, Any]]] = {}
        for stream, version, etype, payload, _, _, _ in sorted(
                history, key=lambda h: (self.taken_by[(h[0], h[1])], h[4])):  # (extraction, position)
            if etype not in SHOP.projections["sku_sales"].event_types:
                continue
            n, state = sales.get(payload["sku"], (0, {}))
            sales[payload["sku"]] = (n + 1, fold(state, Event(stream, version, etype, payload)))
        assert {r["sku"]: (r["events"], json.loads(r["state"])) for r in rows_of(self.warehouse, "sku_sales")} == sales

        typed = {r["event_type"]: r["table_name"] for r in rows_of(self.warehouse, event_tables.NAME)}
        for etype in {h[2] for h in history}:
            held = {(r["stream_id"], r["version"]) for r in rows_of(self.warehouse, typed[etype])}
            assert held == {(s, v) for s, v, t, *_ in history if t == etype}, etype




@pytest.mark.slow  # some 20 histories, each with its own store and lake (the 5-minute budget of the issue)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(operations=st.lists(OPERATIONS, min_size=3, max_size=10))
def test_every_projection_through_any_history_equals_a_fold_of_the_store(
    operations: list[tuple[Any, ...]], new_store: Callable[[], StoreDsn], spark: Any, tmp_path_factory: Any
) -> None:
    history = History(new_store(), tmp_path_factory.mktemp("matrix") / "warehouse", spark)
    for operation in [("append", [(0, "ItemAdded", "A", 1, 1.0)]), ("extract", 1, 1), *operations]:
        history.run(operation)
    history.assert_every_table_equals_the_store()


def test_an_update_before_events_exists_says_to_extract_first(warehouse: Path) -> None:
    for update in (lambda: stream_state.update_stream_state(Engine(), warehouse, domain=SHOP),
                   lambda: update_stream_catalog(Engine(), warehouse), lambda: update_event_type_daily(Engine(), warehouse),
                   lambda: cross_stream.update(warehouse, SHOP, "sku_sales"), lambda: event_tables.update(warehouse, SHOP)):
        with pytest.raises(NoEventsYet, match="no `events` table at .* yet: extract first"):
            update()
    assert not warehouse.exists() or not any(warehouse.iterdir()), "nothing written"
