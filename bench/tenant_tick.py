"""The sensor's tick on a tenant-partitioned store: 1 tenant partition vs 200, same events.

`python -m bench.tenant_tick` (BENCH_TENANT_EVENTS, default 200,000; BENCH_TENANTS, default 200)

The store is the original design notes' hand-rolled table, `PARTITION BY LIST ("TenantId")`, served by a
custom mapping and prepared by `source adopt` (tx_id added, both indexes built per partition). As in
`sensor_tick`: every slice's watermark at the horizon, then one new event per range; the probe (one
statement, median of 50) and the sensor's store work per tick (its kept connection, the source check, the
probe), and the same on a new connection per tick as the sensor did before. The baseline is the same store
with one partition, measured in the same run.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from typing import Any

import psycopg
from psycopg import sql

from bench.common import drop_database, fresh_database, wait_until_extractable
from bench.results import Goal, machine_facts, write_result
from es_pipeline.extraction.offsets import check_source
from es_pipeline.extraction.probe import TAIL_ROWS, probe, probe_statement
from es_pipeline.extraction.slices import split
from es_pipeline.source.mapping import Source, hashed_slice
from es_pipeline.store.adopt import adopt
from es_pipeline.store.conninfo import KeptConnection, connect

REPEATS = 50


def _source() -> Source:
    return Source(
        name="tenant-bench", schema="app", table="Event", stream_id='"StreamId"', version='"Version"',
        event_type='"Type"', payload='"Data"', recorded_at='"LogDate"', global_position='"SequenceNum"',
        tenant='"TenantId"', stream_type="'cart'",
        columns=("SequenceNum", "TenantId", "StreamId", "Version", "Type", "Data", "LogDate"),
    )


def _store(dsn: str, tenants: int, events: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute('CREATE SCHEMA app; CREATE TABLE app."Event" ("SequenceNum" bigint GENERATED ALWAYS AS IDENTITY, '
                  '"TenantId" text NOT NULL, "StreamId" text NOT NULL, "Version" int NOT NULL, "Type" text NOT NULL, '
                  '"Data" jsonb NOT NULL, "LogDate" timestamptz NOT NULL DEFAULT now(), '
                  'PRIMARY KEY ("TenantId", "StreamId", "Version")) PARTITION BY LIST ("TenantId")')
        for t in range(tenants):
            c.execute(f'CREATE TABLE app."Event_t{t}" PARTITION OF app."Event" FOR VALUES IN (\'t{t}\')')
        per_tx = 20_000
        for start in range(0, events, per_tx):  # streams of 20 events, dealt round-robin to the tenants
            c.execute('INSERT INTO app."Event" ("TenantId", "StreamId", "Version", "Type", "Data") '
                      "SELECT 't' || ((i / 20) %% %s::int), 's-' || (i / 20), (i %% 20) + 1, 'ItemAdded', "
                      "'{\"sku\": \"x\"}' FROM generate_series(%s::bigint, %s::bigint) AS i", (tenants, start, min(events, start + per_tx) - 1))
    adopt(dsn, _source(), echo=lambda _: None)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute('VACUUM ANALYZE app."Event"')
        c.execute("CHECKPOINT")


def _median_ms(fn: Any, repeats: int = REPEATS) -> tuple[float, Any]:
    fn()
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000, result


def _tick(dsn: str, tenants: int) -> dict[str, Any]:
    source = _source()
    # "Every slice's watermark at the horizon" means past every store event: a transaction open elsewhere on the
    # server while the store was written would leave the horizon below some of them, and the probe find them.
    wait_until_extractable(dsn)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DELETE FROM es_pipeline.offsets")
        c.execute("INSERT INTO es_pipeline.offsets (consumer, slice, watermark) SELECT %s, s, "
                  "pg_snapshot_xmin(pg_current_snapshot()) FROM generate_series(0, 1023) s", (source.consumer,))
        ranges, n = split(8), 0
        wanted: set[str] = set()
        while len(wanted) < len(ranges):  # one new event in each range, in tenants spread over the partitions
            sid = f"new-{n}"
            s = c.execute(f"SELECT {hashed_slice('%s::text')}", (sid,)).fetchone()[0]  # type: ignore[index]
            key = next(r.key for r in ranges if s in r.slices)
            if key not in wanted:
                wanted.add(key)
                c.execute('INSERT INTO app."Event" ("TenantId", "StreamId", "Version", "Type", "Data") '
                          "VALUES (%s, %s, 1, 'ItemAdded', '{}')", (f"t{(n * 37) % tenants}", sid))
            n += 1
    # The horizon is server-wide: a transaction open elsewhere on the server (a test beside the smoke run) holds
    # the new events above it, and the probe rightly finds none ready. Measured once they are below it.
    wait_until_extractable(dsn)
    with connect(dsn, autocommit=True) as conn:
        probe_ms, found = _median_ms(lambda: probe(conn, source, source.consumer).ready_slices)
        # On the same connection, its caches warm as a kept connection's are (a first plan reads the catalog).
        plan = "\n".join(r[0] for r in conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, SUMMARY) ") + probe_statement(source), {"consumer": source.consumer}))

    def ask(c: psycopg.Connection) -> frozenset[int]:
        check_source(c, source.consumer, source)
        return probe(c, source, source.consumer).ready_slices

    def new_connection_tick() -> frozenset[int]:
        with connect(dsn, autocommit=True, application_name="es_pipeline sensor") as c:
            return ask(c)

    kept = KeptConnection(dsn, "es_pipeline sensor")  # what the sensor does now: one connection, kept
    tick_ms, again = _median_ms(lambda: kept.run(ask))
    kept.close()
    fresh_ms, again_fresh = _median_ms(new_connection_tick, repeats=20)
    if not (found == again == again_fresh) or len(found) != len(ranges):
        raise SystemExit(f"tenant_tick: the probe found {len(found)} ready slices, expected {len(ranges)}")
    planning, execution = (float(re.search(rf"{w} Time: ([0-9.]+) ms", plan).group(1))  # type: ignore[union-attr]
                           for w in ("Planning", "Execution"))
    return {"tenants": tenants, "probe_ms": probe_ms, "whole_tick_ms": tick_ms, "new_connection_tick_ms": fresh_ms,
            "planning_ms": planning, "execution_ms": execution, "ready_slices": len(found)}


def main() -> None:
    events = int(os.environ.get("BENCH_TENANT_EVENTS", "200000"))
    many = int(os.environ.get("BENCH_TENANTS", "200"))
    figures: dict[str, Any] = {}
    for label, tenants in (("one", 1), ("many", many)):
        db = f"bench_tenants_{label}"
        dsn = fresh_database(db)
        try:
            _store(dsn, tenants, events)
            figures[label] = _tick(dsn, tenants)
        finally:
            drop_database(db)
    one, lots = figures["one"], figures["many"]
    rows = [[text, f"{one[k]:.2f}", f"{lots[k]:.2f}", f"{lots[k] / one[k]:.2f}"]
            for k, text in (("probe_ms", "probe: the tail statement (the steady state's only one)"),
                            ("planning_ms", "  its planning (EXPLAIN ANALYZE, warm connection)"),
                            ("execution_ms", "  its execution (EXPLAIN ANALYZE, warm connection)"),
                            ("whole_tick_ms", "the sensor's store work per tick: kept connection, source check, probe"),
                            ("new_connection_tick_ms", "the same on a new connection per tick (before)"))]
    write_result(
        "tenant_tick",
        title=f"the sensor's tick on a tenant-partitioned store: 1 vs {many} tenant partitions, {events:,} events",
        facts=machine_facts(),
        parameters={"events": events, "tenants": many, "repeats": REPEATS, "tail_rows": TAIL_ROWS},
        columns=["what", "1 partition: median ms ← baseline", f"{many} partitions: median ms", f"{many} / 1"],
        rows=rows,
        figures=figures,
        goals=[Goal(f"whole tick, {many} / 1 partitions", lots["whole_tick_ms"] / one["whole_tick_ms"], "<=", 1.5)],
    )


if __name__ == "__main__":
    main()
