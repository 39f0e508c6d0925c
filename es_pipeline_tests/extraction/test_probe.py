"""The sensor's decision as a pure function, and its probe against the real Postgres."""

from __future__ import annotations

import random

import psycopg
import pytest
from psycopg import sql

from es_pipeline.dev.workload import bulk_load
from es_pipeline.extraction.offsets import EVENTS_CONSUMER
from es_pipeline.extraction.probe import Probe, decide, format_cursor, parse_cursor, probe, probe_statement
from es_pipeline.extraction.slices import split
from es_pipeline.store.conninfo import connect
from es_pipeline.store.event_store import EventStore, NewEvent

RANGES = split(8)


@pytest.mark.parametrize(
    ("ready", "cursor", "queued", "expected"),
    [
        pytest.param(set(), {}, set(), [], id="nothing-new"),
        pytest.param({5, 700}, {}, set(), ["0000-0127", "0640-0767"], id="two-ranges"),
        pytest.param({5}, {"0000-0127": 100}, set(), [], id="same-horizon-asked-already"),
        pytest.param({5}, {"0000-0127": 90}, set(), ["0000-0127"], id="older-horizon-asks-again"),
        pytest.param({5}, {"0000-0127": 999}, set(), ["0000-0127"], id="stale-cursor-from-the-future-hides-nothing"),
        pytest.param({5, 130}, {}, {"0000-0127"}, ["0128-0255"], id="queued-run-gets-no-second"),
    ],
)
def test_decide(ready: set[int], cursor: dict[str, int], queued: set[str], expected: list[str]) -> None:
    d = decide(RANGES, Probe(100, frozenset(ready)), cursor, queued)
    assert [k for k, _ in d.requests] == expected
    assert all(run_key == f"{k}:100" for k, run_key in d.requests)
    for k in expected:
        assert d.cursor[k] == 100


def test_a_range_whose_run_failed_at_this_horizon_is_asked_again_under_a_new_key() -> None:
    """In a quiet store the horizon does not move: after a failed run, the cursor and the run key (Dagster runs
    a key once) would keep its events waiting for ever."""
    found = Probe(100, frozenset({5, 130}))
    d = decide(RANGES, found, {"0000-0127": 100, "0128-0255": 100}, failed={"0000-0127": (100, "abcdef123456")})
    assert d.requests == [("0000-0127", "0000-0127:100:after-abcdef12")]
    assert d.skipped == {"0128-0255": "already requested at horizon 100"}
    older = decide(RANGES, found, {"0000-0127": 100}, failed={"0000-0127": (90, "abcdef123456")})
    assert older.requests == [("0128-0255", "0128-0255:100")], "a failure at another horizon changes nothing"


@pytest.mark.parametrize("text", [None, "", "not json", "[1,2]", '{"0000-0127": "x"}'])
def test_an_unreadable_cursor_counts_as_empty(text: str | None) -> None:
    assert parse_cursor(text) == {} or parse_cursor(text) == {}
    assert parse_cursor(format_cursor({"a": 1})) == {"a": 1}


def test_probe_sees_committed_events_below_the_horizon_only(dsn: str) -> None:
    store = EventStore(dsn)
    store.append("cart-a", "cart", [NewEvent("ItemAdded", {})], 0)
    open_tx = store.connect()
    open_tx.execute("BEGIN")
    store.append("cart-open", "cart", [NewEvent("ItemAdded", {})], 0, conn=open_tx)
    store.append("cart-b", "cart", [NewEvent("ItemAdded", {})], 0)
    try:
        with connect(dsn, autocommit=True) as conn:
            found = probe(conn, "es", EVENTS_CONSUMER)
        assert found.ready_slices == {store.slice_of("cart-a")}, "cart-b committed above the horizon"
    finally:
        open_tx.execute("COMMIT")
        open_tx.close()
    with connect(dsn, autocommit=True) as conn:
        found = probe(conn, "es", EVENTS_CONSUMER)
        assert found.ready_slices == {store.slice_of(s) for s in ("cart-a", "cart-open", "cart-b")}
        # Once the watermark of every slice passes the horizon, nothing is ready.
        conn.execute(
            "INSERT INTO es_pipeline.offsets (consumer, slice, watermark) "
            "SELECT %s, s, %s::text::xid8 FROM generate_series(0, 1023) s",
            (EVENTS_CONSUMER, str(found.horizon)),
        )
        assert probe(conn, "es", EVENTS_CONSUMER).ready_slices == frozenset()


def _truth(conn: psycopg.Connection, watermarks: dict[int, int], horizon: int) -> frozenset[int]:
    """The ready slices below `horizon` by brute force: every event read, compared in Python."""
    rows = conn.execute("SELECT slice, tx_id::text::bigint FROM es.events").fetchall()
    return frozenset(s for s, tx in rows if watermarks.get(s, 0) <= tx < horizon)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_probe_equals_brute_force_for_every_tail_length(dsn: str, seed: int) -> None:
    """Whether the tail covers everything or is cut (and lagging slices are probed one by one), the
    answer is the same as reading every event; watermarks fall on, between and around transactions."""
    rng = random.Random(seed)
    store = EventStore(dsn)
    versions: dict[str, int] = {}
    with store.connect() as conn:
        for _ in range(40):  # 40 transactions, 1-8 events each, over 60 streams
            with conn.transaction():
                for _ in range(rng.randint(1, 8)):
                    sid = f"s-{rng.randrange(60)}"
                    store.append(sid, "cart", [NewEvent("ItemAdded", {})], versions.get(sid, 0), conn=conn)
                    versions[sid] = versions.get(sid, 0) + 1
    with connect(dsn, autocommit=True) as conn:
        txs = sorted({r[0] for r in conn.execute("SELECT tx_id::text::bigint FROM es.events")})
        slices = sorted({r[0] for r in conn.execute("SELECT DISTINCT slice FROM es.events")})
        for trial in range(6):
            conn.execute("DELETE FROM es_pipeline.offsets")
            # Trial 0: no offsets at all; later trials: some slices (with and without events) get one.
            chosen = [] if trial == 0 else rng.sample(range(1024), 900) + rng.sample(slices, len(slices) // 2)
            marks = {s: rng.choice(txs) + rng.choice((-1, 0, 0, 1)) for s in set(chosen)}
            if trial == 5:  # every slice has an offset, most caught up: the steady state
                marks = {s: txs[-1] + 1 for s in range(1024)} | {s: rng.choice(txs) for s in rng.sample(slices, 5)}
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO es_pipeline.offsets (consumer, slice, watermark) VALUES (%s, %s, %s::text::xid8)",
                    [(EVENTS_CONSUMER, s, str(w)) for s, w in marks.items()],
                )
            for tail_rows in (1, 2, 7, 50, 512):
                found = probe(conn, "es", EVENTS_CONSUMER, tail_rows=tail_rows)
                # The horizon moves with any transaction in the cluster: judge at the probe's own.
                expected = _truth(conn, marks, found.horizon)
                assert found.ready_slices == expected, f"trial {trial}, tail_rows {tail_rows}"


def test_probe_plan_reads_the_tail_in_the_steady_state(dsn: str) -> None:
    """Caught-up watermarks: the plan reads the end of the tx_id index, and no slice is probed one by one (that
    second statement runs only when the tail is cut)."""
    bulk_load(dsn, events=100_000, streams=1000, events_per_tx=50_000)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE es.events")
        conn.execute(
            "INSERT INTO es_pipeline.offsets (consumer, slice, watermark) SELECT 'events', s, "
            "pg_snapshot_xmin(pg_current_snapshot()) FROM generate_series(0, 1023) s"
        )
    EventStore(dsn).append("cart-new", "cart", [NewEvent("ItemAdded", {})], 0)
    with psycopg.connect(dsn, autocommit=True) as conn:
        plan = "\n".join(r[0] for r in conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) ") + probe_statement("es"), {"consumer": EVENTS_CONSUMER}
        ))
        assert probe(conn, "es", EVENTS_CONSUMER).ready_slices == {EventStore(dsn).slice_of("cart-new")}
    assert "Index Scan Backward using events_tx_order_idx" in plan, plan
    assert "events_slice_tx_idx" not in plan, plan


def test_slices_awaiting_their_catch_up_are_ready_without_new_events(dsn: str) -> None:
    """After a rebase, a slice whose restored events all lie above the horizon has nothing below it: the probe
    must still ask for its first run, or (one run per range) the catch-up would wait for new writes for ever."""
    store = EventStore(dsn)
    store.append("cart-a", "cart", [NewEvent("ItemAdded", {})], 0)
    with connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO es_pipeline.offsets (consumer, slice, watermark) "
                     "SELECT %s, s, pg_snapshot_xmin(pg_current_snapshot()) FROM generate_series(0, 1023) s",
                     (EVENTS_CONSUMER,))
        assert probe(conn, "es", EVENTS_CONSUMER).ready_slices == set(), "every event is below the watermarks"
        conn.execute("INSERT INTO es_pipeline.rebase_catchup (consumer, slice) VALUES (%s, 5), (%s, 700)",
                     (EVENTS_CONSUMER, EVENTS_CONSUMER))
        found = probe(conn, "es", EVENTS_CONSUMER)
    assert found.ready_slices == {5, 700}
    assert [k for k, _ in decide(RANGES, found, {}).requests] == ["0000-0127", "0640-0767"]
