"""typed_event_tables: the typed event tables' first build and increments, and an analyst's first answer.

Over one store and one lake, in one run:
- the `events` backfill of the bulk load (the baseline: es_pipeline's own extraction, ADBC → Arrow → Delta);
- the typed event tables' first build over the same events (`event_tables.update`: every payload parsed,
  a table per type), as events/s against the backfill's;
- `es-pipeline sql` with a GROUP BY over `events`, each engine in its own process from its start to its last
  line of output, as an analyst runs it: DuckDB (the default) against Spark (`--engine spark`);
- 300 more event types, then 1,000-event increments spread over all of them (each increment touches every
  type's table): the typed tables' update, median of the repeats.
"""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from bench.common import (
    ALL_SLICES,
    EVENTS_PER_STREAM,
    SCHEMA,
    Sizes,
    Timing,
    load_events,
    log,
    wait_until_extractable,
)
from bench.extract_incremental import append_increment
from bench.results import Goal, n, ratio, secs
from es_pipeline.domain import NO_DOMAIN, Domain
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.lake.delta import tables
from es_pipeline.lake.typed import event_tables
from es_pipeline.store.event_store import EventStore, NewEvent

NAME = "typed_event_tables"
UPCAST = Domain("bench, upcast")  # an upcaster on the bulk load's Deposited events: the value-by-value path


@UPCAST.upcaster("Deposited", version=1)
def _with_currency(payload: dict) -> dict:
    return {**payload, "currency": payload.get("currency", "EUR")}


TYPES = int(os.environ.get("BENCH_TYPES", "300"))  # the smoke run (`make test`) takes fewer
SPARK_SQL = os.environ.get("BENCH_SQL_SPARK", "1") != "0"  # the smoke run leaves out Spark's half (its JVM's start)
BIN = Path(sys.executable).parent
QUERY = "SELECT event_type, count(*) AS events, count(DISTINCT stream_id) AS streams FROM events GROUP BY 1 ORDER BY 1"


def _sql(lake: Path, engine: str) -> tuple[float, str]:
    """`es-pipeline sql` in its own process, timed from its start to its exit; its output."""
    env = {**os.environ, "ES_PIPELINE_WAREHOUSE": str(lake), "ES_PIPELINE_SPARK_MASTER": "local[2]"}
    t0 = time.perf_counter()
    done = subprocess.run([str(BIN / "es-pipeline"), "sql", QUERY, "--engine", engine, "--format", "csv"],
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"es-pipeline sql --engine {engine} failed: {done.stderr[-2000:]}")
    return seconds, done.stdout


def _append_spread(store: EventStore, versions: dict[str, int], events: int, round_: int) -> None:
    """`events` events over the TYPES event types (one stream per type), each type's in one append."""
    per_type = [events // TYPES + (1 if i < events % TYPES else 0) for i in range(TYPES)]
    for i, k in enumerate(per_type):
        if not k:
            continue
        stream = f"typed-{i}"
        batch = [NewEvent(f"Bench{i}Happened", {"n": round_ * 1000 + j, "label": f"r{round_}", "ok": j % 2 == 0,
                                                 "detail": {"at": j, "tags": ["x", "y"]}}) for j in range(k)]
        versions[stream] = store.append(stream, "typed", batch, versions.get(stream, 0))


def run(dsn: str, work: Path, sizes: Sizes) -> dict[str, Any]:
    events = sizes.events
    streams = max(1, events // EVENTS_PER_STREAM)
    lake = work / "lake"
    log.info("[%s] loading %s events over %s streams", NAME, f"{events:,}", f"{streams:,}")
    load_events(dsn, events, streams)
    wait_until_extractable(dsn)
    extractor = Extractor(dsn, None, lake, schema=SCHEMA, progress=log.info)
    t0 = time.perf_counter()
    moved = extractor.run(ALL_SLICES, run_id="bench-typed-backfill").rows
    backfill = Timing("events backfill (ADBC → Arrow → Delta) ← baseline", moved, time.perf_counter() - t0)
    if moved != events:
        raise RuntimeError(f"the backfill brought {moved:,} of {events:,} events")

    log.info("[%s] typed event tables, first build", NAME)
    t0 = time.perf_counter()
    built = event_tables.update(lake, NO_DOMAIN, progress=log.info)
    build = Timing("typed event tables, first build (a table per type, every payload parsed)", built.events_folded,
                   time.perf_counter() - t0, {"tables": built.figures["tables_written"]})
    if built.events_folded != events or not built.full_rebuild:
        raise RuntimeError(f"the typed tables took {built.events_folded:,} of {events:,} events")
    log.info("[%s] the same with an upcaster on Deposited (those payloads value by value, in Python)", NAME)
    t0 = time.perf_counter()
    upcast = event_tables.update(lake, UPCAST)
    build_upcast = Timing("the same, with an upcaster on Deposited: its payloads (2/3 of all) typed value by value "
                          "in Python", upcast.events_folded, time.perf_counter() - t0)
    if upcast.events_folded != events or not upcast.full_rebuild:
        raise RuntimeError(f"the upcast build took {upcast.events_folded:,} of {events:,} events")

    log.info("[%s] es-pipeline sql, DuckDB then Spark (each in its own process)", NAME)
    duck_seconds, duck_out = _sql(lake, "duckdb")
    if SPARK_SQL:
        spark_seconds, spark_out = _sql(lake, "spark")
        if duck_out.splitlines() != spark_out.splitlines():
            raise RuntimeError(f"the engines disagree:\n{duck_out}\n{spark_out}")
    else:
        spark_seconds = float("nan")
    duck = Timing("es-pipeline sql (DuckDB, the default): GROUP BY over events, process start to exit", events,
                  duck_seconds)
    spark = Timing("es-pipeline sql --engine spark: the same query ← baseline", events, spark_seconds)

    log.info("[%s] %d more event types, then %d-event increments over all of them", NAME, TYPES, sizes.increment)
    store = EventStore(dsn, SCHEMA)
    versions: dict[str, int] = {}
    _append_spread(store, versions, TYPES * 10, 0)
    wait_until_extractable(dsn)
    extractor.run(ALL_SLICES, run_id="bench-typed-types")
    event_tables.update(lake, NO_DOMAIN)
    def tick(label: str, append: Callable[[], None], run_id: str) -> Timing:
        """`append` new events, extract them, then time the typed tables' update alone."""
        append()
        wait_until_extractable(dsn)
        if extractor.run(ALL_SLICES, run_id=run_id).rows != sizes.increment:
            raise RuntimeError("the increment did not reach the lake whole")
        t0 = time.perf_counter()
        done = event_tables.update(lake, NO_DOMAIN)
        if done.events_folded != sizes.increment:
            raise RuntimeError(f"the tick wrote {done.events_folded} events")
        return Timing(label, done.events_folded, time.perf_counter() - t0, {"tables_written": done.figures["tables_written"]})

    ticks, spread = [], []
    for i in range(sizes.repeats):
        ticks.append(tick(f"#{i + 1}", functools.partial(append_increment, dsn, 700 + i, sizes.increment),
                          f"bench-typed-mix-{i}"))  # one type
        spread.append(tick(f"#{i + 1}", functools.partial(_append_spread, store, versions, sizes.increment, i + 1),
                           f"bench-typed-tick-{i}"))  # every one of the 300 types
        written = (spread[-1].extra or {})["tables_written"]
        if written != min(TYPES, sizes.increment):
            raise RuntimeError(f"the spread tick wrote {written} tables")
        log.info("[%s]   increment %d: %.2f s (one type), %.2f s over %d tables", NAME, i + 1,
                 ticks[-1].seconds, spread[-1].seconds, written)
    median = statistics.median(t.seconds for t in ticks)
    median_spread = statistics.median(t.seconds for t in spread)
    total_types = len(tables.table_names(lake, event_tables.PREFIX))
    with psycopg.connect(dsn) as conn:
        in_store = conn.execute("SELECT count(*) FROM es.events").fetchone()[0]  # type: ignore[index]

    build_ratio = build.rate / backfill.rate
    engine_ratio = spark.seconds / duck.seconds
    return {
        "title": "Typed event tables: first build against the events backfill, a 1,000-event increment over 300 "
                 "types, and an analyst's first answer by DuckDB against Spark",
        "parameters": {"events": events, "streams": streams, "event_types": total_types, "increment": sizes.increment,
                       "repeats": sizes.repeats, "events_in_store": in_store, "cores": os.cpu_count()},
        "columns": ["measurement", "events", "seconds", "events/s", "ratio"],
        "rows": [
            [backfill.label, n(backfill.events), secs(backfill.seconds), n(backfill.rate), "1.00"],
            [build.label, n(build.events), secs(build.seconds), n(build.rate), ratio(build_ratio)],
            [build_upcast.label, n(build_upcast.events), secs(build_upcast.seconds), n(build_upcast.rate),
             ratio(build_upcast.rate / backfill.rate)],
            [spark.label, n(events), secs(spark.seconds), "", "1.00"],
            [duck.label, n(events), secs(duck.seconds), "", f"{engine_ratio:.1f}× faster"],
            *[[f"typed tables update, {n(t.events)} new Deposited events in a lake of {total_types} types: {t.label}",
               n(t.events), secs(t.seconds), n(t.rate), ""] for t in ticks],
            *[[f"the same, the events spread over {TYPES} types (every table written): {t.label}", n(t.events),
               secs(t.seconds), n(t.rate), ""] for t in spread],
        ],
        "figures": {"backfill": backfill.as_dict(), "build": build.as_dict(), "build_upcast": build_upcast.as_dict(),
                    "build_ratio_to_backfill": round(build_ratio, 4), "sql_duckdb_s": round(duck.seconds, 3),
                    "sql_spark_s": round(spark.seconds, 3), "sql_spark_over_duckdb": round(engine_ratio, 2),
                    "increment_median_s": round(median, 4), "increments_s": [round(t.seconds, 4) for t in ticks],
                    "increment_spread_median_s": round(median_spread, 4),
                    "increments_spread_s": [round(t.seconds, 4) for t in spread]},
        "goals": [Goal("typed tables first build / events backfill, events/s", build_ratio, ">=", 0.5),
                  Goal(f"1,000-event increment in a lake of {TYPES}+ types, median seconds", median, "<", 1.0),
                  *([Goal("es-pipeline sql: Spark seconds / DuckDB seconds (first answer)", engine_ratio, ">=", 10)]
                    if SPARK_SQL else [])],
        "notes": [
            "Backfill: `Extractor.run` over every slice into an empty lake (the `events` rate the issue compares "
            "with). The bulk load's payloads: `Opened` {owner, currency} once per stream, then `Deposited` and "
            "`Withdrawn` {amount} (3 types). First build: `event_tables.update` with no table there: `events`' files read by pyarrow a "
            "million rows at a time, grouped by type, each group's payloads parsed by Arrow's JSON reader (the "
            "rule's exact cases value by value), each type's table written by delta-rs. Events/s counts every "
            "event, as the backfill does.",
            "sql: each engine in a fresh process, timed from the command's start to its exit, the same query, "
            "answers compared line by line: what an analyst waits for the first answer. Spark's time includes the "
            "JVM's start and the tables' registration; DuckDB's the `delta` extension's load.",
            f"Increments: {sizes.increment:,} Deposited events (new account streams, as `extract_incremental` appends "
            f"them) in a lake that holds {TYPES} more types, then {sizes.increment:,} events spread evenly over those {TYPES} types (one "
            f"stream per type), so that the update writes {TYPES} tables: the worst case of a tick, one Delta commit per "
            "table. Timed: `event_tables.update` alone, after the extraction.",
        ],
    }
