"""The sensor's decision as a pure function, and its probe against the real Postgres."""

from __future__ import annotations

import psycopg
import pytest

from es_pipeline.event_store import EventStore, NewEvent
from es_pipeline.extract import EVENTS_CONSUMER
from es_pipeline.pg import connect
from es_pipeline.sensing import Probe, decide, format_cursor, parse_cursor, probe
from es_pipeline.slices import split

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


def test_probe_plan_is_index_probes(dsn: str) -> None:
    from es_pipeline.demo import bulk_load

    bulk_load(dsn, events=100_000, streams=1000, events_per_tx=50_000)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE es.events")
        conn.execute(
            "INSERT INTO es_pipeline.offsets (consumer, slice, watermark) SELECT 'events', s, "
            "pg_snapshot_xmin(pg_current_snapshot()) FROM generate_series(0, 1023) s"
        )
        plan = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN SELECT 1 FROM es.events e WHERE e.slice = 5::smallint AND e.tx_id >= '1'::xid8 AND e.tx_id < '2'::xid8"
        ))
    assert "events_slice_tx_idx" in plan
