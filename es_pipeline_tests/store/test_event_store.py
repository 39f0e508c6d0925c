"""The event store against the real Postgres: appends, conflicts, bad input, slices, NOTIFY."""

from __future__ import annotations

import threading
from collections import Counter

import psycopg
import pytest

from es_pipeline.errors import ConcurrencyError, InvalidAppend
from es_pipeline.store.event_store import EventStore, NewEvent, Snapshot


def _count(dsn: str, table: str = "es.events") -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        assert row is not None
        return int(row[0])


def test_append_creates_stream_and_reads_back_in_version_order(dsn: str) -> None:
    store = EventStore(dsn)
    v = store.append("cart-1", "cart", [NewEvent("ItemAdded", {"sku": "a", "qty": 1})], 0)
    v = store.append("cart-1", "cart", [NewEvent("ItemAdded", {"sku": "b", "qty": 2}), NewEvent("CheckedOut", {})], v)
    events = store.read_stream("cart-1")
    assert v == 3
    assert [e.version for e in events] == [1, 2, 3]
    assert [e.event_type for e in events] == ["ItemAdded", "ItemAdded", "CheckedOut"]
    assert events[1].payload == {"sku": "b", "qty": 2}
    assert len({e.tx_id for e in events[1:]}) == 1, "one append is one transaction"
    assert store.stream_version("cart-1") == 3


@pytest.mark.parametrize("expected", [0, 1])
def test_two_writers_on_one_stream_exactly_one_wins(dsn: str, expected: int) -> None:
    """Both writers saw the same version; both append at once; one commits, one gets ConcurrencyError."""
    store = EventStore(dsn)
    if expected:
        store.append("acc-1", "account", [NewEvent("Opened", {"owner": "x"})], 0)
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def writer(name: str) -> None:
        with store.connect() as conn:
            with conn.transaction():
                barrier.wait()
                try:
                    store.append("acc-1", "account", [NewEvent("Deposited", {"amount": 1, "by": name})], expected, conn=conn)
                    outcomes.append("won")
                except ConcurrencyError as exc:
                    assert exc.expected == expected and exc.actual == expected + 1
                    outcomes.append("lost")

    threads = [threading.Thread(target=writer, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["lost", "won"]
    assert [e.version for e in store.read_stream("acc-1")] == list(range(1, expected + 2))


def test_wrong_expected_version_raises_and_writes_nothing(dsn: str) -> None:
    store = EventStore(dsn)
    store.append("s-1", "cart", [NewEvent("ItemAdded", {"sku": "a"})], 0)
    before = _count(dsn)
    with pytest.raises(ConcurrencyError, match="is at version 1, but the append expected 5"):
        store.append("s-1", "cart", [NewEvent("ItemAdded", {"sku": "b"})], 5)
    with pytest.raises(ConcurrencyError):
        store.append("s-1", "cart", [NewEvent("ItemAdded", {"sku": "b"})], 0)
    assert _count(dsn) == before
    assert store.stream_version("s-1") == 1


@pytest.mark.parametrize(
    ("stream_id", "events", "message"),
    [
        ("s-1", [], "list of events is empty"),
        ("s-1", [NewEvent("X", {"when": object()})], "not JSON-serialisable"),
        ("s-1", [NewEvent("X", {"v": float("nan")})], "not JSON-serialisable"),
        ("x" * 201, [NewEvent("X", {})], "at most 200 allowed"),
        ("", [NewEvent("X", {})], "non-empty string"),
        ("s-\x00-1", [NewEvent("X", {})], "stream id holds a NUL character"),
        ("s-1", [NewEvent("X\x00", {})], "event type holds a NUL character"),
        ("s-1", [NewEvent("X", {"note": "a\x00b"})], "payload holds a NUL character"),
    ],
)
def test_bad_appends_are_refused_with_a_clear_error_and_write_nothing(
    dsn: str, stream_id: str, events: list[NewEvent], message: str
) -> None:
    store = EventStore(dsn)
    with pytest.raises(InvalidAppend, match=message):
        store.append(stream_id, "cart", events, 0)
    assert _count(dsn) == 0
    assert _count(dsn, "es.streams") == 0


def test_a_backslash_before_u0000_is_text_not_a_nul(dsn: str) -> None:
    EventStore(dsn).append("s-1", "cart", [NewEvent("X", {"path": "C:\\u0000"})], 0)
    assert _count(dsn) == 1


def test_slice_is_stable_in_range_and_spreads_streams_evenly(dsn: str) -> None:
    store = EventStore(dsn)
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT es.slice_of('stream-' || i) FROM generate_series(1, 102400) AS i"
        ).fetchall()
        again = conn.execute("SELECT es.slice_of('stream-' || i) FROM generate_series(1, 1000) AS i").fetchall()
    slices = [r[0] for r in rows]
    assert all(0 <= s < 1024 for s in slices)
    assert [r[0] for r in again] == slices[:1000], "same id, same slice"
    counts = Counter(slices)
    assert len(counts) == 1024
    # 100 expected per slice; a fair hash stays well within ±50% (binomial sd ≈ 10).
    assert min(counts.values()) > 50 and max(counts.values()) < 150
    # The one definition lives in the database; the Python helper asks it. Pinned so it never drifts.
    assert store.slice_of("cart-1") == slices_of_known(dsn)


def slices_of_known(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT (hashtextextended('cart-1', 0) & 1023)::int").fetchone()
        assert row is not None
        return int(row[0])


def test_slice_function_cannot_overflow_on_extreme_hashes(dsn: str) -> None:
    """abs(min bigint) overflows; the bitwise AND used by slice_of is total."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT ((-9223372036854775807::bigint - 1) & 1023)::smallint").fetchone()
    assert row == (0,)


def test_one_notify_per_appending_transaction(dsn: str) -> None:
    store = EventStore(dsn)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN es_events")
        with store.connect() as conn, conn.transaction():
            for i in range(3):
                store.append(f"cart-{i}", "cart", [NewEvent("ItemAdded", {"i": i}), NewEvent("ItemAdded", {"i": i})], 0, conn=conn)
        store.append("cart-9", "cart", [NewEvent("ItemAdded", {})], 0)
        with store.connect() as conn, conn.transaction():
            store.append("cart-8", "cart", [NewEvent("ItemAdded", {})], 0, conn=conn)
            raise psycopg.Rollback()  # a rolled-back append notifies nobody
        notes = list(listener.notifies(timeout=1.0))
    assert len(notes) == 2, [n.payload for n in notes]
    assert all(n.channel == "es_events" for n in notes)
    assert len({n.payload for n in notes}) == 2


def test_load_is_snapshot_plus_later_events(dsn: str) -> None:
    store = EventStore(dsn)
    v = store.append("acc-9", "account", [NewEvent("Deposited", {"amount": 10}), NewEvent("Deposited", {"amount": 5})], 0)
    store.write_snapshots([Snapshot("acc-9", "account", v, {"balance": 15}, 1)])
    store.append("acc-9", "account", [NewEvent("Withdrawn", {"amount": 3})], v)

    def fold(state: dict, event) -> dict:  # type: ignore[no-untyped-def]
        sign = -1 if event.event_type == "Withdrawn" else 1
        return {"balance": state.get("balance", 0) + sign * event.payload["amount"]}

    assert store.load("acc-9", fold, revision=1) == ({"balance": 12}, 3)
    # A snapshot of another revision is ignored: full replay.
    assert store.load("acc-9", fold, revision=2) == ({"balance": 12}, 3)


def test_load_with_the_domains_fold_applies_its_upcasters_and_uses_the_lakes_snapshots(dsn: str) -> None:
    """docs/writing.md: `load` folds events as stored; the domain's `folds[type]` is the reducer behind its upcasters,
    at the revision `stream_state` and its snapshots record."""
    from shop.domain import domain as shop

    store = EventStore(dsn)
    store.append("cart-9", "cart", [NewEvent("ItemAdded", {"sku": "a", "qty": 2, "price": 1.25})], 0)  # old shape
    cart = shop.folds["cart"]
    state, version = store.load("cart-9", cart.fold, revision=cart.revision)
    assert (state["prices"], state["total"], version) == ({"a": 1.25}, 2.5, 1)
    assert cart.revision == shop.revisions()["cart"] == shop.reducers["cart"].revision + 1  # one upcaster
    raw, _ = store.load("cart-9", shop.reducers["cart"].fold, revision=1)
    assert raw["prices"] == {}, "the reducer alone sees the stored payload, without its upcaster"


@pytest.mark.parametrize(
    ("statement", "refused"),
    [
        ("INSERT INTO es.events (tx_id, stream_id, stream_type, version, event_type, payload) "
         "VALUES ('3'::xid8, 'forged-1', 'cart', 1, 'ItemAdded', '{}')", "tx_id is set by the database"),
        ("UPDATE es.events SET payload = '{}' WHERE stream_id = 'cart-g'", "append-only: UPDATE"),
        ("DELETE FROM es.events WHERE stream_id = 'cart-g'", "append-only: DELETE"),
        ("TRUNCATE es.events", "append-only: TRUNCATE"),
    ],
)
def test_events_cannot_be_forged_below_a_watermark_or_rewritten(dsn: str, statement: str, refused: str) -> None:
    """A row placed below a watermark, or changed after extraction, would leave the lake silently different."""
    EventStore(dsn).append("cart-g", "cart", [NewEvent("ItemAdded", {"sku": "a"})], 0)
    with psycopg.connect(dsn) as conn, pytest.raises(psycopg.Error, match=refused):
        conn.execute(statement)
    assert _count(dsn) == 1
    with psycopg.connect(dsn) as conn:
        mine = conn.execute(
            "INSERT INTO es.events (tx_id, stream_id, stream_type, version, event_type, payload) "
            "VALUES (pg_current_xact_id(), 'own-1', 'cart', 1, 'ItemAdded', '{}') RETURNING tx_id = pg_current_xact_id()"
        ).fetchone()
    assert mine == (True,), "naming the writer's own transaction is allowed"
