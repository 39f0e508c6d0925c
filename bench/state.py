"""stream_state benchmarks: an increment's cost against the history folded, and a full rebuild's speed.

state_incremental: 1,000 new events folded with a small history already folded (baseline), then again
after the history has grown ten times; the figure is the ratio of median times, large / small.

state_rebuild: `update_stream_state` on an empty state over the whole `events` table (every event
through its reducer), by the default path and by Spark, next to a plain Spark `groupBy` aggregate of the
same events written to Delta: the floor that any per-stream computation sits on. The figure is the
default fold's events/s over the floor's.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from shop.domain import domain as _SHOP

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
from es_pipeline.domain import Domain, Event, State
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.offsets import batch_frontier
from es_pipeline.lake import cross_stream
from es_pipeline.lake.delta import tables
from es_pipeline.lake.kernel.engine import SPARK_BYTES, Engine
from es_pipeline.lake.kernel.result import Result
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.lake.typed import event_tables

INCREMENTAL = "state_incremental"
REBUILD = "state_rebuild"
GOAL_RATIO = 1.3
FLOOR_RUNS = 3


def _extract(dsn: str, work: Path, run_id: str) -> int:
    return Extractor(dsn, None, work / "lake", schema=SCHEMA, progress=log.info).run(ALL_SLICES, run_id=run_id).rows


# The shop's reducers without their history (bench/history.py measures it): these figures are stream_state's and
# its typed tables', as before history.
SHOP = Domain("shop, no history")
for _reducer in _SHOP.reducers.values():
    SHOP.add(dataclasses.replace(_reducer, history=None))
for _upcaster in _SHOP.upcasters.values():
    SHOP.add_upcaster(_upcaster)

# The shop's reducers without their state declarations: no typed tables to keep (the typed tables' baseline).
UNTYPED = Domain("shop, untyped")
for _reducer in SHOP.reducers.values():
    UNTYPED.add(dataclasses.replace(_reducer, state=None))
for _upcaster in SHOP.upcasters.values():  # the same revisions as the shop's: no type rebuilt between the series
    UNTYPED.add_upcaster(_upcaster)


# A cross-stream projection over the bulk load's account events: money moved, by whole amount (about 140 keys,
# each folding events of thousands of streams).
MOVED = Domain("bench, cross-stream")


@MOVED.projection("moved_by_amount", events=["Deposited", "Withdrawn"], key=lambda e: str(int(e.payload["amount"])),
                  key_column="amount", revision=1)
def _moved(state: State, event: Event) -> State:
    amount = float(event.payload["amount"])
    if event.event_type == "Deposited":
        return {"in": state.get("in", 0.0) + amount, "out": state.get("out", 0.0), "last": event.stream_id}
    return {"in": state.get("in", 0.0), "out": state.get("out", 0.0) + amount, "last": event.stream_id}


def _fold(spark: Any, work: Path, *, small: bool = True, domain: Domain = SHOP) -> tuple[float, Result]:
    t0 = time.perf_counter()
    result = update_stream_state(Engine(spark=spark, small_increments=small), work / "lake", domain=domain)
    return time.perf_counter() - t0, result


def _series(
    dsn: str, spark: Any, work: Path, sizes: Sizes, phase: str, first_round: int, *, small: bool,
    domain: Domain = SHOP,
) -> list[Timing]:
    timings = []
    for i in range(sizes.repeats):
        append_increment(dsn, 500 + first_round + i, sizes.increment)
        wait_until_extractable(dsn)
        if _extract(dsn, work, f"bench-state-{phase}-{i}") != sizes.increment:
            raise RuntimeError(f"{phase} #{i}: the increment did not reach the lake whole")
        seconds, r = _fold(spark, work, small=small, domain=domain)
        if r.events_folded != sizes.increment:
            raise RuntimeError(f"{phase} #{i}: folded {r.events_folded:,} events, expected {sizes.increment:,}")
        timings.append(Timing(f"{phase} #{i + 1}", r.events_folded, seconds, {"streams_updated": r.figures["streams_updated"]}))
        log.info("[%s]   %s increment %d: %.2f s", INCREMENTAL, phase, i + 1, seconds)
    return timings


def run_incremental(dsn: str, spark: Any, work: Path, sizes: Sizes) -> dict[str, Any]:
    streams = max(1, sizes.small // EVENTS_PER_STREAM)
    growth = (sizes.large - sizes.small) // streams * streams
    log.info("[%s] small history: %s events over %s streams", INCREMENTAL, f"{sizes.small:,}", f"{streams:,}")
    load_events(dsn, sizes.small, streams)
    wait_until_extractable(dsn)
    lake_small = _extract(dsn, work, "bench-state-small")
    fold_small, _ = _fold(spark, work)
    _fold(spark, work)  # nothing new: warms the no-op path, not timed
    log.info("[%s] small history folded (%.1f s); increments:", INCREMENTAL, fold_small)
    spark_small = _series(dsn, spark, work, sizes, "small, Spark", 0, small=False)
    untyped = _series(dsn, spark, work, sizes, "small, no typed tables", 50, small=True, domain=UNTYPED)
    _fold(spark, work)  # the typed tables catch up on the untyped increments: not timed
    small = _series(dsn, spark, work, sizes, "small", 100, small=True)

    log.info("[%s] growing the history by %s events", INCREMENTAL, f"{growth:,}")
    load_events(dsn, growth, streams)
    wait_until_extractable(dsn)
    lake_large = lake_small + sum(t.events for t in spark_small + small) + _extract(dsn, work, "bench-state-growth")
    fold_growth, _ = _fold(spark, work)
    log.info("[%s] large history folded (%.1f s); increments:", INCREMENTAL, fold_growth)
    spark_large = _series(dsn, spark, work, sizes, "large, Spark", 200, small=False)
    large = _series(dsn, spark, work, sizes, "large", 300, small=True)

    med_spark = statistics.median(t.seconds for t in spark_small)
    med_spark_large = statistics.median(t.seconds for t in spark_large)
    med_small = statistics.median(t.seconds for t in small)
    med_untyped = statistics.median(t.seconds for t in untyped)
    med_large = statistics.median(t.seconds for t in large)
    state_rows = int(tables.read(spark, str(work / "lake" / "stream_state")).count())

    def row(label: str, lake: int, ts: list[Timing], med: float, baseline: bool = False) -> list[str]:
        return [label + (" ← baseline" if baseline else ""), n(lake), n(sizes.increment), secs(med),
                secs(min(t.seconds for t in ts)), secs(max(t.seconds for t in ts)), ratio(med / med_spark)]

    return {
        "title": "stream_state: an increment of 1,000 events on Spark and in Arrow with delta-rs, small vs large history",
        "parameters": {"small": sizes.small, "large_target": sizes.large, "streams": streams,
                       "increment": sizes.increment, "repeats": sizes.repeats,
                       "spark_master": spark.sparkContext.master},
        "columns": ["history, engine", "events folded", "new events", "median s", "min s", "max s",
                    "ratio to Spark, small"],
        "rows": [row("small, Spark", lake_small, spark_small, med_spark, baseline=True),
                 row("small, Arrow + delta-rs, no typed tables", lake_small, untyped, med_untyped),
                 row("small, Arrow + delta-rs (default: + typed tables of cart, account)", lake_small, small, med_small),
                 row("large, Spark", lake_large, spark_large, med_spark_large),
                 row("large, Arrow + delta-rs (default)", lake_large, large, med_large)],
        "figures": {
            "median_seconds_small": round(med_small, 3), "median_seconds_large": round(med_large, 3),
            "median_seconds_small_spark": round(med_spark, 3), "median_seconds_large_spark": round(med_spark_large, 3),
            "ratio_large_to_small": round(med_large / med_small, 4), "state_rows_at_end": state_rows,
            "median_seconds_small_untyped": round(med_untyped, 3),
            "ratio_typed_to_untyped": round(med_small / med_untyped, 4),
            "runs_small_untyped": [t.as_dict() for t in untyped],
            "fold_small_history_seconds": round(fold_small, 2), "fold_growth_seconds": round(fold_growth, 2),
            "runs_small": [t.as_dict() for t in small], "runs_large": [t.as_dict() for t in large],
            "runs_small_spark": [t.as_dict() for t in spark_small], "runs_large_spark": [t.as_dict() for t in spark_large],
        },
        "goals": [Goal("median s, 1,000 events, small history (default path)", med_small, "<", 1.0),
                  Goal("median s, 1,000 events, large history (default path)", med_large, "<", 1.0),
                  Goal("median large / median small (default path)", med_large / med_small, "<=", GOAL_RATIO),
                  Goal("median with typed tables / without (default path)", med_small / med_untyped, "<=", 1.3)],
        "notes": [
            f"Each increment: {sizes.increment:,} account events on new streams (10 per transaction), extracted "
            "(not timed), then `update_stream_state` timed end to end. Spark: the change feed of the new `events` "
            "commit, the fold (`mapInArrow` per partition), the MERGE. Arrow + delta-rs (lake/state/stream_state.py's small increment, "
            "the default up to 200,000 new events): the change feed read by delta-rs, the state table read whole, "
            f"the same fold in this process, a delta-rs MERGE. Median of {sizes.repeats} each.",
            "Typed tables: the shop's reducers declare their states (examples/shop), so the default increment also "
            "keeps `stream_state_account` and `stream_state_cart` from the rows `stream_state`'s commit wrote "
            "(appended: the increments' streams are new; docs/decisions.md); the row "
            "without them folds with the same reducers, their declarations left out.",
        ],
    }


def run_rebuild(dsn: str, spark: Any, work: Path, sizes: Sizes) -> dict[str, Any]:
    from pyspark.sql import functions as F

    events = sizes.events
    streams = max(1, events // EVENTS_PER_STREAM)
    log.info("[%s] loading %s events over %s streams", REBUILD, f"{events:,}", f"{streams:,}")
    load_events(dsn, events, streams)
    wait_until_extractable(dsn)
    if _extract(dsn, work, "bench-state-rebuild") != events:
        raise RuntimeError("the backfill did not bring every event")
    lake = work / "lake"
    source = tables.read(spark, str(lake / "events"))

    def floor_job() -> None:
        (source.groupBy("stream_id").agg(
            F.first("stream_type").alias("stream_type"), F.max("version").alias("version"),
            F.count(F.lit(1)).alias("events"), F.sum(F.length("payload")).alias("payload_bytes"),
            F.max("recorded_at").alias("last_event_at"),
        ).write.format("delta").mode("overwrite").save(str(work / "groupby")))

    log.info("[%s] plain groupBy floor (once to warm the JVM, then the fastest of %d)", REBUILD, FLOOR_RUNS)
    floor_job()
    floor_seconds = []
    for _ in range(FLOOR_RUNS):  # it varied 3.0-4.7 s from one run to the next: the fastest is the strict floor
        t0 = time.perf_counter()
        floor_job()
        floor_seconds.append(time.perf_counter() - t0)
    floor = Timing("plain Spark groupBy aggregate → Delta ← baseline (fastest of 3)", events, min(floor_seconds),
                   {"runs_s": [round(x, 2) for x in floor_seconds]})

    state_path = lake / "stream_state"
    log.info("[%s] full fold, the default path (in-process up to %d MiB of events)", REBUILD, SPARK_BYTES >> 20)
    seconds, r = _fold(spark, work)
    if r.events_folded != events or r.previous_events_version != -1:
        raise RuntimeError(f"the rebuild folded {r.events_folded:,} of {events:,} events")
    fold = Timing("stream_state first build, default: in-process, one forked fold per core (lake/state/whole_fold.py)",
                  events, seconds, {"streams": r.figures["streams_updated"]})
    default_rows = tables.read(spark, str(state_path)).count()
    shutil.rmtree(state_path)
    log.info("[%s] full fold on Spark", REBUILD)
    seconds, r = _fold(spark, work, small=False)
    if r.events_folded != events or r.previous_events_version != -1 or default_rows != r.figures["streams_updated"]:
        raise RuntimeError(f"the Spark rebuild folded {r.events_folded:,} of {events:,} events")
    fold_spark = Timing("stream_state first build on Spark (shuffle by stream, sort, `mapInArrow` fold, MERGE)",
                        events, seconds, {"streams": r.figures["streams_updated"]})

    log.info("[%s] cross-stream projection, first build", REBUILD)
    consumer = Extractor(dsn, None, lake, schema=SCHEMA).consumer
    t0 = time.perf_counter()
    crossed = cross_stream.update(lake, MOVED, "moved_by_amount", store_dsn=dsn,
                                  frontier=lambda: batch_frontier(dsn, consumer))
    cross = Timing("cross-stream projection first build (moved_by_amount: 2 event types by a payload key, in-process)",
                   events, time.perf_counter() - t0, {"keys": crossed.rows, "events_folded": crossed.events_folded})
    if crossed.previous_events_version != -1 or crossed.events_folded + streams != events:
        raise RuntimeError(f"the cross-stream build folded {crossed.events_folded:,} events")
    in_process_rows = tables.read(spark, str(lake / "moved_by_amount")).count()
    shutil.rmtree(lake / "moved_by_amount")
    log.info("[%s] cross-stream projection, first build on Spark", REBUILD)
    t0 = time.perf_counter()
    crossed = cross_stream.update(lake, MOVED, "moved_by_amount", store_dsn=dsn, engine=Engine("spark", spark),
                                  frontier=lambda: batch_frontier(dsn, consumer))
    cross_spark = Timing("cross-stream projection first build on Spark (keyed by `mapInArrow`, shuffled by key, sorted, "
                         "folded by `mapInArrow`, Parquet by Spark, committed by delta-rs)", events,
                         time.perf_counter() - t0, {"keys": crossed.rows, "events_folded": crossed.events_folded})
    if crossed.engine != "spark" or crossed.events_folded + streams != events or crossed.rows != in_process_rows:
        raise RuntimeError(f"the cross-stream build on Spark folded {crossed.events_folded:,} events")

    log.info("[%s] typed event tables, first build in process, then on Spark", REBUILD)
    t0 = time.perf_counter()
    typed = event_tables.update(lake, MOVED, engine=Engine("local"))
    typed_local = Timing("typed event tables first build, in process (a table per type, every payload parsed)",
                         events, time.perf_counter() - t0, {"tables": typed.figures["tables_written"]})
    for name in event_tables.table_names(lake):
        shutil.rmtree(lake / name)
    t0 = time.perf_counter()
    typed = event_tables.update(lake, MOVED, engine=Engine("spark", spark))
    typed_spark = Timing("typed event tables first build on Spark (two `mapInArrow` jobs: columns found, rows placed "
                         "and written by the executors; committed by delta-rs)", events, time.perf_counter() - t0,
                         {"tables": typed.figures["tables_written"]})
    if typed.engine != "spark" or typed.events_folded != events:
        raise RuntimeError(f"the typed build on Spark wrote {typed.events_folded:,} events")

    def row(t: Timing) -> list[str]:
        return [t.label, n(t.events), secs(t.seconds), n(t.rate), ratio(t.rate / floor.rate)]

    return {
        "title": "stream_state and a cross-stream projection: full rebuild vs a plain groupBy over the same events",
        "parameters": {"events": events, "streams": streams, "spark_master": spark.sparkContext.master,
                       "in_process_up_to_mib": SPARK_BYTES >> 20, "cores": os.cpu_count()},
        "columns": ["measurement", "events", "seconds", "events/s", "ratio to groupBy"],
        "rows": [row(floor), row(fold), row(fold_spark), row(cross), row(cross_spark), row(typed_local),
                 row(typed_spark)],
        "figures": {"groupby": floor.as_dict(), "fold": fold.as_dict(), "fold_spark": fold_spark.as_dict(),
                    "cross_stream": cross.as_dict(), "cross_stream_spark": cross_spark.as_dict(),
                    "typed_tables": typed_local.as_dict(), "typed_tables_spark": typed_spark.as_dict(),
                    "fold_ratio_to_groupby": round(fold.rate / floor.rate, 4),
                    "fold_spark_ratio_to_groupby": round(fold_spark.rate / floor.rate, 4),
                    "cross_stream_ratio_to_groupby": round(cross.rate / floor.rate, 4),
                    "cross_stream_spark_ratio_to_groupby": round(cross_spark.rate / floor.rate, 4),
                    "typed_tables_spark_ratio_to_groupby": round(typed_spark.rate / floor.rate, 4)},
        "goals": [Goal("full fold (default path) / groupBy floor, events/s", fold.rate / floor.rate, ">=", 0.5),
                  Goal("cross-stream first build / groupBy floor, events/s", cross.rate / floor.rate, ">=", 0.3),
                  Goal("stream_state first build on Spark / groupBy floor, events/s", fold_spark.rate / floor.rate,
                       ">=", 0.5),
                  Goal("cross-stream first build on Spark / groupBy floor, events/s", cross_spark.rate / floor.rate,
                       ">=", 0.5),
                  Goal("typed event tables first build on Spark / groupBy floor, events/s",
                       typed_spark.rate / floor.rate, ">=", 0.5)],
        "notes": [
            "Floor: `groupBy(stream_id)` with first type, max version, count, payload bytes and last time, "
            f"written to Delta (no Python); the fastest of {FLOOR_RUNS} runs after a warm-up one. Folds: `update_stream_state` on an empty `stream_state`, every event "
            "through its reducer. Default: `events`' files read by pyarrow, split by slice over one forked "
            "process per core, each ordering its share by stream (dictionary codes, not strings) and folding it "
            "stream by stream, the rows written by delta-rs (tables up "
            f"to {SPARK_BYTES >> 20} MiB of Parquet; larger ones go to Spark). Spark: partitioned by stream, "
            "sorted by version, folded by `mapInArrow`, then the MERGE. Same session, same lake; the state "
            "table is removed between the two folds.",
            "Cross-stream: `cross_stream.update` on no table, the store's batch frontier read first: `events`' files "
            "read by pyarrow (rows of the two types kept), every payload parsed and keyed, sorted by key and the "
            "lake's order, folded, written by delta-rs; events/s counts every event of `events` as the floor does.",
            "On Spark (issue 42), the same builds with `ES_PIPELINE_ENGINE=spark`, on the same session: "
            "`stream_state` logs its two phases (the fold: shuffle by stream, sort, `mapInArrow`; then the write). "
            "Profiled at 1M events (steady state, this machine): the scan 0.6 s, the shuffle by stream +0.3 s, the "
            "sort +0.35-0.7 s, the Arrow hand-off to the Python workers ~0.5 s, the fold itself ~1.3 s (Python: "
            "the reducers, event by event: the in-process fold's own cost), the cached figures 0.5 s, the write "
            "1.5 s. The Python fold alone is about the whole floor's time (the in-process fold, with no shuffle, "
            "sits at ~0.5 of it), so on two cores no Spark fold reaches 0.5 of a groupBy that runs no Python: what "
            "would is a fold the JVM runs (reducers as Spark expressions) or more cores per event than the floor's. "
            "The typed tables parse every payload twice on Spark (their columns, then their rows).",
        ],
    }
