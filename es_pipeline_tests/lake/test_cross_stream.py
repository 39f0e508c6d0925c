"""Cross-stream projections (lake/cross_stream.py): every key equal to a fold of the store's events in the lake's
order, through concurrent writers, a batch left pending by a killed run, out-of-order batch commits and rebuilds.
The order expected is modelled from the batches the test's runs made (`Batches`), never read from the lake."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any, TypedDict

import psycopg
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.dev.workload import run_workload
from es_pipeline.domain import Domain, Event
from es_pipeline.errors import ProjectionFoldError
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.offsets import Batch, batch_frontier
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.lake import cross_stream
from es_pipeline.lake.delta import pieces, tables
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.source import mapping
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.hooks import Crash, crash_at
from es_pipeline_tests.support.lakecheck import assert_exactly_once_by_key, extract_all
from es_pipeline_tests.support.roles import StoreDsn

NAME = "sku_sales"


def _frontier(dsn: StoreDsn) -> Any:
    consumer = mapping.load(None, "es").consumer
    return lambda: batch_frontier(dsn.extractor, consumer)


class Batches:
    """Every batch the test's extraction runs made, as they made them (their slices, lower bounds and upper bound, from
    the runs' own step hook): the order a cross-stream projection folds in, modelled from what the test ran, never
    read from the lake. Pass it as an `Extractor`'s `on_step` (`then` another hook)."""

    def __init__(self) -> None:
        self.made: dict[int, Batch] = {}

    def __call__(self, step: str, batch: Batch | None) -> None:
        if batch is not None and batch.batch_id is not None:
            self.made[batch.batch_id] = batch

    def then(self, hook: Any) -> Any:
        def both(step: str, batch: Batch | None) -> None:
            self(step, batch)
            hook(step, batch)
        return both

    def of(self, slice_: int, tx: int) -> int:
        """The batch that took the event of slice `slice_` and transaction `tx`: exactly one (exactly once)."""
        found = [b.batch_id for b in self.made.values() if slice_ in b.slices and b.batch_id is not None
                 and b.from_watermarks[b.slices.index(slice_)] <= tx < b.upper]
        assert len(found) == 1, f"an event of slice {slice_}, transaction {tx}, taken by batches {found}"
        return found[0]


@pytest.fixture
def batches() -> Batches:
    return Batches()


def _expected(dsn: StoreDsn, batches: Batches, domain: Domain = SHOP, name: str = NAME) -> dict[tuple[str, str], Any]:
    """Each key's state folded independently: the store's events of the projection's types, in the order of the
    batches that took them (`Batches`), then their position, by the projection's fold."""
    projection = domain.projections[name]
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT '', stream_id, version, event_type, payload, global_position, slice, tx_id::text::bigint "
            "FROM es.events WHERE event_type = ANY(%s)", (list(projection.event_types),)).fetchall()
    keyed = sorted(((t, str(p[projection.key]), batches.of(sl, tx), gp, s, v, e, p)
                    for t, s, v, e, p, gp, sl, tx in rows if projection.key in p), key=lambda r: r[:6])
    out: dict[tuple[str, str], Any] = {}
    for tenant, key, _, _, sid, version, event_type, payload in keyed:
        state, n = out.get((tenant, key), ({}, 0))
        out[(tenant, key)] = (projection.fold(state, Event(sid, version, event_type, payload)), n + 1)
    return out


def _table(warehouse: Path, name: str = NAME, key: str = "sku") -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["tenant"], r[key]): r for r in DeltaTable(str(warehouse / name)).to_pyarrow_table().to_pylist()}


def _assert_equal_to_the_store(dsn: StoreDsn, warehouse: Path, batches: Batches) -> int:
    expected, held = _expected(dsn, batches), _table(warehouse)
    assert set(held) == set(expected), set(held) ^ set(expected)
    for k, (state, n) in expected.items():
        row = held[k]
        assert json.loads(row["state"]) == state, k
        assert row["events"] == n, k
        assert {f: row[f] for f in state} == state, k  # the declared fields as columns
    return sum(n for _, n in expected.values())


@pytest.mark.slow
def test_a_projection_equals_a_fold_of_the_store_through_a_killed_run_concurrent_writers_and_rebuilds(
    dsn: StoreDsn, warehouse: Path, batches: Batches
) -> None:
    store = EventStore(dsn)
    run_workload(store, streams=60, events=900, writers=4, rollback_rate=0.1, max_commit_delay=0.01, seed=31)
    extract_all(dsn.extractor, None, warehouse, on_step=batches)
    built = cross_stream.update(warehouse, SHOP, NAME, store_dsn=dsn.extractor, frontier=_frontier(dsn))
    assert built.previous_events_version == -1 and built.figures["keys_updated"] == len(_table(warehouse))
    assert _assert_equal_to_the_store(dsn, warehouse, batches) == built.events_folded > 0

    # A run of range 0-511 killed after it took its batch id: the batch stays pending. Range 512-1023 commits a
    # later batch meanwhile; its events wait (a lower batch may still come) rather than fold before it.
    run_workload(store, streams=60, events=600, writers=4, rollback_rate=0.1, max_commit_delay=0.01, seed=32)
    low, high = SliceRange(0, 511), SliceRange(512, 1023)
    with pytest.raises(Crash):
        Extractor(dsn.extractor, None, warehouse, on_step=batches.then(crash_at("read"))).run(low)
    assert Extractor(dsn.extractor, None, warehouse, on_step=batches).run(high).rows > 0
    waiting = cross_stream.update(warehouse, SHOP, NAME, store_dsn=dsn.extractor, frontier=_frontier(dsn))
    assert waiting.figures["events_waiting"] > 0 and waiting.events_folded == 0 and waiting.figures["keys_refolded"] == 0
    assert Extractor(dsn.extractor, None, warehouse, on_step=batches).run(low).replayed_batches == 1
    caught_up = cross_stream.update(warehouse, SHOP, NAME, store_dsn=dsn.extractor, frontier=_frontier(dsn))
    assert caught_up.figures["events_waiting"] == 0 and caught_up.figures["keys_refolded"] == 0 and caught_up.events_folded > 0
    assert caught_up.previous_events_version >= 0  # an increment, not a rebuild
    total = _assert_equal_to_the_store(dsn, warehouse, batches)

    # Nothing new: nothing folded, nothing committed.
    version = DeltaTable(str(warehouse / NAME)).version()
    assert cross_stream.update(warehouse, SHOP, NAME, store_dsn=dsn.extractor, frontier=_frontier(dsn)).events_folded == 0
    assert DeltaTable(str(warehouse / NAME)).version() == version

    # Built again from nothing (a second table of the same definition), it holds the same rows: the order is the lake's.
    again = Domain("again")
    again.add_projection(SHOP.projections[NAME].__class__(**{**SHOP.projections[NAME].__dict__, "name": "sku_again"}))
    cross_stream.update(warehouse, again, "sku_again", store_dsn=dsn.extractor, frontier=_frontier(dsn))
    strip = ("updated_at",)
    assert {k: {c: v for c, v in r.items() if c not in strip} for k, r in _table(warehouse, "sku_again").items()} == \
        {k: {c: v for c, v in r.items() if c not in strip} for k, r in _table(warehouse).items()}
    assert total > 0 and assert_exactly_once_by_key(warehouse, dsn) > total


@pytest.mark.slow
def test_without_a_frontier_a_batch_that_lands_late_folds_its_keys_again(
    dsn: StoreDsn, warehouse: Path, batches: Batches
) -> None:
    store = EventStore(dsn)
    run_workload(store, streams=40, events=400, writers=3, rollback_rate=0.1, max_commit_delay=0, seed=41)
    extract_all(dsn.extractor, None, warehouse, on_step=batches)
    cross_stream.update(warehouse, SHOP, NAME)  # no store asked: every batch in the lake is taken as final
    run_workload(store, streams=40, events=400, writers=3, rollback_rate=0.1, max_commit_delay=0, seed=42)
    low, high = SliceRange(0, 511), SliceRange(512, 1023)
    with pytest.raises(Crash):
        Extractor(dsn.extractor, None, warehouse, on_step=batches.then(crash_at("read"))).run(low)
    Extractor(dsn.extractor, None, warehouse, on_step=batches).run(high)
    cross_stream.update(warehouse, SHOP, NAME)  # folds the later batch first
    Extractor(dsn.extractor, None, warehouse, on_step=batches).run(low)  # the lower batch lands after it
    late = cross_stream.update(warehouse, SHOP, NAME)
    assert late.figures["keys_refolded"] > 0
    _assert_equal_to_the_store(dsn, warehouse, batches)


def test_upcast_keys_tenants_and_a_failing_fold(dsn: StoreDsn, warehouse: Path) -> None:
    """Upcasters run before the key is read; keys are per tenant; a key missing is counted; a failing fold is named
    and commits nothing."""
    d = Domain("ledger", schema_version="suffix")

    @d.upcaster("Moved", version=1)
    def v1_to_v2(p: dict[str, Any]) -> dict[str, Any]:
        return {"account": p["acct"], "amount": p["amt"]}

    @d.projection("balances", events=["Moved"], key="account", revision=1)
    def balances(state: dict[str, Any], event: Event) -> dict[str, Any]:
        if event.payload["amount"] == 666:
            raise ValueError("cursed amount")
        return {"balance": state.get("balance", 0) + event.payload["amount"]}

    store = EventStore(dsn)
    store.append("t-1", "transfer", [NewEvent("Moved", {"acct": "a", "amt": 5}), NewEvent("Moved.v2", {"account": "b", "amount": 7})], 0)
    store.append("t-2", "transfer", [NewEvent("Moved.v2", {"account": "a", "amount": 1}), NewEvent("Moved.v2", {"note": "no key"})], 0)
    extract_all(dsn.extractor, None, warehouse)
    r = cross_stream.update(warehouse, d, "balances", store_dsn=dsn.extractor, frontier=_frontier(dsn))
    assert r.figures["events_without_key"] == 1
    held = _table(warehouse, "balances", "account")
    assert {k: json.loads(v["state"]) for k, v in held.items()} == {("", "a"): {"balance": 6}, ("", "b"): {"balance": 7}}
    store.append("t-3", "transfer", [NewEvent("Moved.v2", {"account": "a", "amount": 666})], 0)
    extract_all(dsn.extractor, None, warehouse)
    version = DeltaTable(str(warehouse / "balances")).version()
    with pytest.raises(ProjectionFoldError, match="'balances' failed at key 'a' on stream 't-3' version 1"):
        cross_stream.update(warehouse, d.folding("stop"), "balances", store_dsn=dsn.extractor, frontier=_frontier(dsn))
    assert DeltaTable(str(warehouse / "balances")).version() == version


@pytest.mark.slow
@pytest.mark.parametrize("skus", ["strings", "strings and numbers"])
def test_keys_read_by_arrow_equal_keys_read_in_python_and_a_forked_fold_equals_one_process(
    dsn: StoreDsn, warehouse: Path, monkeypatch: pytest.MonkeyPatch, skus: str
) -> None:
    """A field's name as the key is read by Arrow's JSON reader (a function of the event, in Python): the same keys;
    a large read folds over forked processes, whole keys each: the same rows as one process."""
    store = EventStore(dsn)
    run_workload(store, streams=30, events=300, writers=2, rollback_rate=0, max_commit_delay=0, seed=51)
    if skus == "strings and numbers":  # a number where other payloads have a string: Python's str() decides the key
        store.append("cart-n", "cart", [NewEvent("ItemAdded", {"sku": 7, "qty": 1}), NewEvent("ItemRemoved", {"sku": "7"})], 0)
    extract_all(dsn.extractor, None, warehouse)
    by_field, by_function = Domain("by field"), Domain("by function")
    fold = SHOP.projections[NAME].fold
    by_field.projection("by_field", events=["ItemAdded", "ItemRemoved"], key="sku", revision=1)(fold)
    by_function.projection("by_function", events=["ItemAdded", "ItemRemoved"], key=lambda e: e.payload.get("sku"),
                           key_column="sku", revision=1)(fold)
    monkeypatch.setattr("es_pipeline.lake.state.forked.ONE_PROCESS_ROWS", 10)  # forked, two processes
    cross_stream.update(warehouse, by_field, "by_field")
    monkeypatch.setattr("es_pipeline.lake.state.forked.ONE_PROCESS_ROWS", 10**9)  # one process
    cross_stream.update(warehouse, by_function, "by_function")
    strip = ("updated_at",)
    forked = {k: {c: v for c, v in r.items() if c not in strip} for k, r in _table(warehouse, "by_field").items()}
    single = {k: {c: v for c, v in r.items() if c not in strip} for k, r in _table(warehouse, "by_function").items()}
    assert forked == single and len(forked) > 5
    if skus == "strings and numbers":
        assert forked[("", "7")]["events"] == 2
    # One key holding every event: the forked fold cuts at key boundaries only, so it is one process's.
    one = Domain("one key")
    one.projection("one_key", events=["ItemAdded", "ItemRemoved"], key=lambda e: "all", key_column="k", revision=1)(fold)
    monkeypatch.setattr("es_pipeline.lake.state.forked.ONE_PROCESS_ROWS", 10)
    assert cross_stream.update(warehouse, one, "one_key").rows == 1


def test_a_build_read_in_pieces_equals_the_store(dsn: StoreDsn, warehouse: Path, batches: Batches,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Past a piece's bytes (lake/delta/pieces.py) a build reads `events` a few rows at a time, sends each event to
    the piece of its key's hash (on disk), and folds a piece at a time, forked: every key equals a fold of the store,
    and the rows equal the build that read `events` whole."""
    store = EventStore(dsn)
    run_workload(store, streams=40, events=600, writers=4, rollback_rate=0.1, max_commit_delay=0, seed=53)
    extract_all(dsn.extractor, None, warehouse, on_step=batches)
    whole = cross_stream.update(warehouse, SHOP, NAME, frontier=_frontier(dsn))
    held_whole = _table(warehouse)
    size = tables.files_bytes(DeltaTable(str(warehouse / "events")))
    monkeypatch.setattr(pieces, "PIECE_BYTES", size // 5 + 1)  # five pieces
    monkeypatch.setattr(pieces, "BATCH_ROWS", 13)
    monkeypatch.setattr(pieces, "CHUNK_ROWS", 50)
    monkeypatch.setattr("es_pipeline.lake.state.forked.ONE_PROCESS_ROWS", 10)  # each piece forked too
    spread, counts = pieces.spread, []

    def counted(source: Any, schema: Any, count: int, piece_of: Any) -> Any:
        counts.append(count)
        return spread(source, schema, count, piece_of)

    monkeypatch.setattr(pieces, "spread", counted)
    cross_stream.mark_for_rebuild(warehouse, NAME, tables.table_id(str(warehouse / "events")))
    built = cross_stream.update(warehouse, SHOP, NAME, frontier=_frontier(dsn))
    assert built.previous_events_version == -1 and counts == [5], "built again, in five pieces"
    assert (built.events_folded, built.rows, built.figures["events_without_key"]) == \
        (whole.events_folded, whole.rows, whole.figures["events_without_key"])
    assert _assert_equal_to_the_store(dsn, warehouse, batches) == built.events_folded
    strip = ("updated_at",)
    assert {k: {c: v for c, v in r.items() if c not in strip} for k, r in _table(warehouse).items()} == \
        {k: {c: v for c, v in r.items() if c not in strip} for k, r in held_whole.items()}


def test_an_upcaster_of_its_event_types_rebuilds_a_projection(dsn: StoreDsn, warehouse: Path) -> None:
    """The rows depend on the upcasters of the projection's types: registering one rebuilds the table."""
    d = Domain("ledger")
    d.projection("moved", events=["Moved"], key="account", revision=1)(
        lambda state, event: {"n": state.get("n", 0) + event.payload.get("amount", 0)})
    EventStore(dsn).append("t-1", "transfer", [NewEvent("Moved", {"account": "a", "amount": 2})], 0)
    extract_all(dsn.extractor, None, warehouse)
    assert cross_stream.update(warehouse, d, "moved").previous_events_version == -1
    assert cross_stream.update(warehouse, d, "moved").events_folded == 0
    d.upcaster("Moved", version=1)(lambda p: {**p, "amount": p["amount"] * 10})
    again = cross_stream.update(warehouse, d, "moved")
    assert again.previous_events_version == -1
    assert json.loads(_table(warehouse, "moved", "account")[("", "a")]["state"]) == {"n": 20}


class _Place(TypedDict):
    visits: int
    first_at: dt.datetime
    last_at: dt.datetime


@pytest.mark.slow  # make check's budget: the rule itself is checked in test_typed_values / test_state_json
def test_a_projection_state_of_datetimes_round_trips_and_one_that_does_not_fit_is_named(dsn: StoreDsn,
                                                                                      warehouse: Path) -> None:
    d = Domain("places")

    @d.projection("places", events=["Visited"], key="place", revision=1, state=_Place)
    def places(state: dict[str, Any], event: Event) -> dict[str, Any]:
        at = dt.datetime.fromisoformat(event.payload["at"])
        if event.payload.get("bad"):
            return {**state, "last_at": event.payload["at"]}  # a string where a datetime is declared
        first = state.get("first_at")
        return {"visits": state.get("visits", 0) + 1, "first_at": min(first, at) if first else at,
                "last_at": max(state.get("last_at") or at, at)}  # datetimes compared: from the last run's JSON too

    store = EventStore(dsn)
    store.append("v-1", "visitor", [NewEvent("Visited", {"place": "desk", "at": "2026-11-27T10:00:00+01:00"})], 0)
    extract_all(dsn.extractor, None, warehouse)
    cross_stream.update(warehouse, d, "places", store_dsn=dsn.extractor, frontier=_frontier(dsn))
    store.append("v-2", "visitor", [NewEvent("Visited", {"place": "desk", "at": "2026-11-27T08:30:00+00:00"})], 0)
    extract_all(dsn.extractor, None, warehouse)
    cross_stream.update(warehouse, d, "places", store_dsn=dsn.extractor, frontier=_frontier(dsn))
    row = _table(warehouse, "places", "place")[("", "desk")]
    assert (row["visits"], row["first_at"], row["last_at"]) == (
        2, dt.datetime(2026, 11, 27, 8, 30, tzinfo=dt.UTC), dt.datetime(2026, 11, 27, 9, tzinfo=dt.UTC))
    store.append("v-3", "visitor", [NewEvent("Visited", {"place": "desk", "at": "2026-11-28T08:00:00+00:00",
                                                         "bad": True})], 0)
    extract_all(dsn.extractor, None, warehouse)
    version = DeltaTable(str(warehouse / "places")).version()
    with pytest.raises(ProjectionFoldError, match="'places' failed at key 'desk' on stream 'v-3' version 1: its "
                                                  "state's field 'last_at' holds a str \\(declared a datetime"):
        cross_stream.update(warehouse, d, "places", store_dsn=dsn.extractor, frontier=_frontier(dsn))
    assert DeltaTable(str(warehouse / "places")).version() == version


def test_a_build_on_spark_equals_the_build_in_process_and_an_increment_goes_on_from_it(
    dsn: StoreDsn, spark: Any, warehouse: Path, batches: Batches
) -> None:
    """The issue-42 path: the whole build keyed and folded on Spark's executors, committed by delta-rs with the same
    three transaction ids; equal to the in-process build row for row; the next increment (in process) goes on from
    it; a failing fold on Spark is named as in process."""
    store = EventStore(dsn)
    run_workload(store, streams=30, events=500, writers=2, rollback_rate=0.1, max_commit_delay=0, seed=42)
    extract_all(dsn.extractor, None, warehouse, on_step=batches)
    on_spark = cross_stream.update(warehouse, SHOP, NAME, store_dsn=dsn.extractor, frontier=_frontier(dsn),
                                   engine=Engine("spark", spark))
    assert on_spark.previous_events_version == -1 and on_spark.events_folded > 0 and on_spark.engine == "spark"
    spark_rows = _table(warehouse)
    _assert_equal_to_the_store(dsn, warehouse, batches)
    lake_rebuild = cross_stream.update(warehouse, SHOP, NAME, store_dsn=dsn.extractor, frontier=_frontier(dsn))
    assert lake_rebuild.events_folded == 0  # nothing new: Spark's commit carried the three numbers
    cross_stream.mark_for_rebuild(warehouse, NAME, str(DeltaTable(str(warehouse / "events")).metadata().id))
    in_process = cross_stream.update(warehouse, SHOP, NAME, store_dsn=dsn.extractor, frontier=_frontier(dsn),
                                     engine=Engine("local", spark))
    assert (in_process.events_folded, in_process.rows, in_process.figures["events_without_key"], in_process.engine) == (
        on_spark.events_folded, on_spark.rows, on_spark.figures["events_without_key"], "local")

    def same(rows: dict[tuple[str, str], dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
        return {k: {c: v for c, v in r.items() if c != "updated_at"} for k, r in rows.items()}

    assert same(_table(warehouse)) == same(spark_rows)
    run_workload(store, streams=10, events=100, writers=1, rollback_rate=0, max_commit_delay=0, seed=43)
    extract_all(dsn.extractor, None, warehouse, on_step=batches)
    cross_stream.update(warehouse, SHOP, NAME, store_dsn=dsn.extractor, frontier=_frontier(dsn),
                        engine=Engine("spark", spark))  # an increment: in process whatever the engine
    _assert_equal_to_the_store(dsn, warehouse, batches)
    cross_stream.mark_for_rebuild(warehouse, NAME, str(DeltaTable(str(warehouse / "events")).metadata().id))
    again = cross_stream.update(warehouse, SHOP, NAME, store_dsn=dsn.extractor, frontier=_frontier(dsn),
                                engine=Engine("spark", spark))  # a rebuild over the same version: replaced all the same
    assert again.previous_events_version == -1
    _assert_equal_to_the_store(dsn, warehouse, batches)

    failing = Domain("failing on spark")

    @failing.projection("cursed", events=["ItemAdded"], key="sku", revision=1)
    def cursed(state: dict[str, Any], event: Event) -> dict[str, Any]:
        raise ValueError("cursed")

    with pytest.raises(ProjectionFoldError, match="'cursed' failed at key '.*' on stream '.*' version [0-9]+ "
                                                  r"\(ItemAdded\): ValueError: cursed"):
        cross_stream.update(warehouse, failing.folding("stop"), "cursed", engine=Engine("spark", spark))
    held = cross_stream.update(warehouse, failing, "cursed", engine=Engine("spark", spark))  # quarantine: every key
    rows = _table(warehouse, "cursed", "sku")
    assert rows and held.figures["keys_quarantined"] == len(rows) and all(r["quarantined"] for r in rows.values())
    assert all(json.loads(r["state"]) == {} and r["events"] == 0 for r in rows.values())
