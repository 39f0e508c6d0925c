"""A demo workload: concurrent writers appending realistic events for two domains.

Shopping carts (ItemAdded / ItemRemoved / CheckedOut) and bank accounts (Opened / Deposited /
Withdrawn / Closed). Each writer has its own connection and owns its own streams; it holds some
transactions open for a random delay so that commit order differs from transaction-id order (the
race that loses events for a reader by sequence; docs/architecture.md), and rolls back a fraction of them. What it reports is exactly what committed.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from es_pipeline.store.event_store import EventStore, NewEvent

SKUS = [f"SKU-{i:04d}" for i in range(200)]
PRICES = {sku: round(random.Random(sku).uniform(1, 200), 2) for sku in SKUS}


@dataclass
class DemoStream:
    stream_id: str
    stream_type: str
    version: int = 0
    tenant: str = ""  # in a store partitioned by tenant
    state: dict[str, Any] = field(default_factory=dict)
    done: bool = False


def next_events(stream: DemoStream, rng: random.Random, n: int) -> tuple[list[NewEvent], dict[str, Any], bool]:
    """Up to `n` plausible next events for a stream, and the state and done flag after them."""
    state: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in stream.state.items()}
    events: list[NewEvent] = []
    done = False
    version = stream.version
    meta_base = {"correlation_id": str(uuid.UUID(int=rng.getrandbits(128))), "user": f"user-{rng.randrange(500)}"}
    for _ in range(n):
        version += 1
        meta = dict(meta_base, causation_id=f"{stream.stream_id}:{version - 1}")
        if stream.stream_type == "cart":
            items: dict[str, int] = state.setdefault("items", {})
            r = rng.random()
            if items and r < 0.2:
                sku = rng.choice(sorted(items))
                events.append(NewEvent("ItemRemoved", {"sku": sku}, meta))
                del items[sku]
            elif items and r < 0.27 and version > 3:
                total = round(sum(PRICES[s] * q for s, q in items.items()), 2)
                events.append(NewEvent("CheckedOut", {"total": total, "items": len(items)}, meta))
                done = True
                break
            else:
                sku = rng.choice(SKUS)
                qty = rng.randint(1, 3)
                events.append(NewEvent("ItemAdded", {"sku": sku, "qty": qty, "unit_price": PRICES[sku]}, meta))
                items[sku] = items.get(sku, 0) + qty
        else:
            if version == 1:
                events.append(NewEvent("Opened", {"owner": f"owner-{rng.randrange(10_000)}", "currency": "EUR"}, meta))
                state["balance"] = 0.0
                continue
            r = rng.random()
            balance = float(state.get("balance", 0.0))
            if r < 0.5:
                amount = round(rng.uniform(5, 500), 2)
                events.append(NewEvent("Deposited", {"amount": amount}, meta))
                state["balance"] = round(balance + amount, 2)
            elif r < 0.96 or version < 5:
                amount = round(rng.uniform(5, 400), 2)
                events.append(NewEvent("Withdrawn", {"amount": amount}, meta))
                state["balance"] = round(balance - amount, 2)
            else:
                events.append(NewEvent("Closed", {"final_balance": balance}, meta))
                done = True
                break
    return events, state, done


@dataclass
class WriterReport:
    events: int = 0
    transactions: int = 0
    rollbacks: int = 0
    streams: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class DemoReport:
    events: int
    transactions: int
    rollbacks: int
    streams: int
    seconds: float
    writers: int

    @property
    def events_per_second(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        return (
            f"committed {self.events} events in {self.transactions} transactions on {self.streams} streams "
            f"({self.rollbacks} transactions rolled back) with {self.writers} writers in {self.seconds:.1f} s: "
            f"{self.events_per_second:,.0f} events/s"
        )


def _writer(
    store: EventStore,
    index: int,
    quota: int | None,
    streams_quota: int,
    rollback_rate: float,
    max_commit_delay: float,
    seed: int,
    stop: threading.Event,
    pace: Callable[[int], None],
    report: WriterReport,
    max_events_per_tx: int,
    tenants: Sequence[str] = (),
) -> None:
    rng = random.Random(seed * 1000 + index)
    pool: list[DemoStream] = []
    created = 0
    with store.connect() as conn:
        while not stop.is_set() and (quota is None or report.events < quota):
            open_streams = [s for s in pool if not s.done]
            if created < streams_quota or not open_streams:
                kind = "cart" if rng.random() < 0.5 else "account"
                stream = DemoStream(f"{kind}-{uuid.uuid4().hex[:16]}", kind, tenant=rng.choice(tenants) if tenants else "")
                pool.append(stream)
                created += 1
            else:
                stream = rng.choice(open_streams)
            n = rng.randint(1, max_events_per_tx)
            if quota is not None:
                n = max(1, min(n, quota - report.events))
            events, state, done = next_events(stream, rng, n)
            rollback = rng.random() < rollback_rate
            delay = rng.uniform(0, max_commit_delay) if max_commit_delay > 0 else 0.0
            try:
                # A rollback by the block's end, not by raising psycopg.Rollback: if the connection is lost
                # meanwhile, that exception would escape as no psycopg.Error; this way the next statement
                # raises OperationalError, which callers riding out a crash catch.
                with conn.transaction(force_rollback=rollback):
                    version = store.append(stream.stream_id, stream.stream_type, events, stream.version, conn=conn,
                                           tenant=stream.tenant)
                    if delay:
                        time.sleep(delay)  # hold the transaction open: commits land out of tx_id order
            except psycopg.OperationalError:
                if stop.is_set():
                    break
                raise
            if rollback:
                report.rollbacks += 1
                continue
            stream.version, stream.state, stream.done = version, state, done
            report.events += len(events)
            report.transactions += 1
            report.streams.add(stream.stream_id)
            pace(len(events))


def run_workload(
    store: EventStore,
    *,
    streams: int = 1000,
    events: int | None = 10_000,
    writers: int = 8,
    rollback_rate: float = 0.1,
    max_commit_delay: float = 0.05,
    seed: int = 42,
    rate: float | None = None,
    stop: threading.Event | None = None,
    max_events_per_tx: int = 4,
    tenants: Sequence[str] = (),
) -> DemoReport:
    """Write `events` events (or until `stop` is set, when `events` is None) from `writers` threads; with
    `tenants`, each new stream belongs to one of them (a store partitioned by tenant)."""
    if writers < 1:
        raise ValueError("writers must be at least 1")
    if not 0 <= rollback_rate < 1:
        raise ValueError("rollback rate must be in [0, 1)")
    stop = stop or threading.Event()
    lock = threading.Lock()
    started = time.monotonic()
    written = [0]

    def pace(n: int) -> None:
        if rate is None:
            return
        with lock:
            written[0] += n
            ahead = written[0] / rate - (time.monotonic() - started)
        if ahead > 0:
            time.sleep(ahead)

    reports = [WriterReport() for _ in range(writers)]
    errors: list[BaseException] = []
    per_writer = None if events is None else [events // writers + (1 if i < events % writers else 0) for i in range(writers)]
    streams_per_writer = max(1, streams // writers)

    def target(i: int) -> None:
        try:
            _writer(store, i, None if per_writer is None else per_writer[i], streams_per_writer, rollback_rate,
                    max_commit_delay, seed, stop, pace, reports[i], max_events_per_tx, tenants)
        except BaseException as exc:  # noqa: BLE001 - surfaced to the caller below
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=target, args=(i,), name=f"demo-writer-{i}", daemon=True) for i in range(writers)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    except KeyboardInterrupt:
        stop.set()
        for t in threads:
            t.join()
    seconds = time.monotonic() - started
    if errors:
        raise errors[0]
    return DemoReport(
        events=sum(r.events for r in reports),
        transactions=sum(r.transactions for r in reports),
        rollbacks=sum(r.rollbacks for r in reports),
        streams=len(set().union(*(r.streams for r in reports))),
        seconds=seconds,
        writers=writers,
    )


def bulk_load(
    dsn: str, *, events: int, streams: int, schema: str = "es", events_per_tx: int = 100_000,
    progress: Callable[[str], None] | None = None,
) -> int:
    """Append `events` account events over `streams` streams, generated inside Postgres (fast).

    For benchmarks and large-table tests: versions stay contiguous per stream (event i belongs to
    stream i % streams at version i // streams + 1), each chunk of `events_per_tx` commits on its own.
    Appends after whatever `bulk-` streams a previous call left. Returns the events written.
    """
    s = sql.Identifier(schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT coalesce(max(version), 0) FROM {}.streams WHERE stream_id LIKE 'bulk-%%'").format(s)
        ).fetchone()
        base = int(row[0]) if row else 0
        if base:
            counts = conn.execute(
                sql.SQL("SELECT count(*) FILTER (WHERE version = %s), count(*) FROM {}.streams "
                        "WHERE stream_id LIKE 'bulk-%%'").format(s), (base,)
            ).fetchone()
            if counts is None or counts[0] != counts[1] or counts[1] != streams:
                raise ValueError("bulk_load appends only to a complete set of bulk streams with the same count")
        start = base * streams
        done = 0
        while done < events:
            n = min(events_per_tx, events - done)
            lo = start + done
            with conn.transaction():
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {s}.events (stream_id, stream_type, version, event_type, payload, metadata) "
                        "SELECT 'bulk-' || lpad((i %% %(streams)s)::text, 8, '0'), 'account', "
                        "       (i / %(streams)s)::int + 1, "
                        "       CASE WHEN i < %(streams)s THEN 'Opened' WHEN i %% 3 = 0 THEN 'Withdrawn' ELSE 'Deposited' END, "
                        "       CASE WHEN i < %(streams)s THEN jsonb_build_object('owner', 'owner-' || i, 'currency', 'EUR') "
                        "            ELSE jsonb_build_object('amount', round((i %% 997)::numeric / 7, 2)) END, "
                        "       jsonb_build_object('correlation_id', md5(i::text), 'user', 'bulk') "
                        "FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS i"
                    ).format(s=s),
                    {"streams": streams, "lo": lo, "hi": lo + n - 1},
                )
            done += n
            if progress:
                progress(f"bulk load: {done:,}/{events:,} events")
        total = start + events
        conn.execute(
            sql.SQL(
                "INSERT INTO {s}.streams (stream_id, stream_type, version) "
                "SELECT 'bulk-' || lpad(k::text, 8, '0'), 'account', "
                "       ((%(total)s - 1 - k) / %(streams)s + 1)::int "
                "FROM generate_series(0, least(%(streams)s, %(total)s) - 1) AS k "
                "ON CONFLICT (stream_id) DO UPDATE SET version = excluded.version, updated_at = now()"
            ).format(s=s),
            {"streams": streams, "total": total},
        )
    return events
