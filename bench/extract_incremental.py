"""extract_incremental: does a small increment cost the same whatever the lake already holds?

The same increment (1,000 new events in 100 transactions of 10) is extracted with a small history
in Postgres and the lake, then again after the history has grown ten times. Baseline: the median
incremental run at the small size; the figure is the ratio large / small.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import (
    ALL_SLICES,
    EVENTS_PER_STREAM,
    EVENTS_PER_TX,
    SCHEMA,
    Sizes,
    Timing,
    load_events,
    log,
    wait_until_extractable,
)
from bench.results import Goal, n, ratio, secs
from es_pipeline.extraction.extractor import Extractor, ExtractResult
from es_pipeline.store.event_store import NO_STREAM, EventStore, NewEvent

NAME = "extract_incremental"
TITLE = "an incremental batch of new events, small vs large history"
GOAL_RATIO = 1.3
EVENTS_PER_NEW_STREAM = 10


def append_increment(dsn: str, round_no: int, count: int) -> None:
    """`count` new events: new streams of 10 events, one transaction per stream, as writers would."""
    store = EventStore(dsn, SCHEMA)
    with store.connect() as conn:
        for k in range(-(-count // EVENTS_PER_NEW_STREAM)):
            size = min(EVENTS_PER_NEW_STREAM, count - k * EVENTS_PER_NEW_STREAM)
            events = [
                NewEvent("Deposited", {"amount": round(1 + (k * 7 + v) % 500 / 3, 2)}, {"user": "bench"})
                for v in range(size)
            ]
            with conn.transaction():
                store.append(f"bench-inc-{round_no:03d}-{k:05d}", "account", events, NO_STREAM, conn=conn)


def timed_run(extractor: Extractor, run_id: str) -> tuple[float, ExtractResult]:
    t0 = time.perf_counter()
    result = extractor.run(ALL_SLICES, run_id=run_id)
    return time.perf_counter() - t0, result


def series(dsn: str, extractor: Extractor, sizes: Sizes, phase: str, first_round: int) -> list[Timing]:
    """`sizes.repeats` increments, each appended, made extractable, then extracted and timed."""
    timings: list[Timing] = []
    for i in range(sizes.repeats):
        append_increment(dsn, first_round + i, sizes.increment)
        wait_until_extractable(dsn)
        seconds, result = timed_run(extractor, f"bench-inc-{phase}-{i}")
        if result.rows != sizes.increment:
            raise RuntimeError(f"increment {phase} #{i}: extracted {result.rows:,} events, expected {sizes.increment:,}")
        timings.append(Timing(f"{phase} #{i + 1}", result.rows, seconds,
                              {"read_seconds": round(result.read_seconds, 4),
                               "write_seconds": round(result.write_seconds, 4)}))
        log.info("[%s]   %s increment %d: %.3f s", NAME, phase, i + 1, seconds)
    return timings


def run(dsn: str, spark: Any, work: Path, sizes: Sizes) -> dict[str, Any]:
    streams = max(1, sizes.small // EVENTS_PER_STREAM)
    # bulk_load appends only whole rounds over the same streams: grow by a multiple of `streams`.
    growth = (sizes.large - sizes.small) // streams * streams
    extractor = Extractor(dsn, spark, work / "lake", schema=SCHEMA, progress=log.info)

    log.info("[%s] loading the small history: %s events over %s streams", NAME, f"{sizes.small:,}", f"{streams:,}")
    load_small = load_events(dsn, sizes.small, streams)
    wait_until_extractable(dsn)
    backfill_small, res = timed_run(extractor, "bench-inc-backfill-small")
    lake_small = res.rows
    log.info("[%s] small history in the lake (%.1f s); increments:", NAME, backfill_small)
    small = series(dsn, extractor, sizes, "small", 0)

    log.info("[%s] growing the history by %s events", NAME, f"{growth:,}")
    load_growth = load_events(dsn, growth, streams)
    wait_until_extractable(dsn)
    backfill_growth, res = timed_run(extractor, "bench-inc-backfill-growth")
    lake_large = lake_small + sum(t.events for t in small) + res.rows
    log.info("[%s] large history in the lake (%.1f s); increments:", NAME, backfill_growth)
    large = series(dsn, extractor, sizes, "large", sizes.repeats)

    med_small = statistics.median(t.seconds for t in small)
    med_large = statistics.median(t.seconds for t in large)

    def row(label: str, lake: int, ts: list[Timing], med: float, baseline: bool = False) -> list[str]:
        return [label + (" ← baseline" if baseline else ""), n(lake), n(sizes.increment), secs(med),
                secs(min(t.seconds for t in ts)), secs(max(t.seconds for t in ts)), ratio(med / med_small)]

    return {
        "title": TITLE,
        "parameters": {"small": sizes.small, "large_target": sizes.large, "streams": streams,
                       "increment": sizes.increment, "repeats": sizes.repeats, "events_per_tx": EVENTS_PER_TX,
                       "spark_master": spark.sparkContext.master},
        "columns": ["history", "events in lake", "new events", "median s", "min s", "max s", "ratio to small"],
        "rows": [row("small", lake_small, small, med_small, baseline=True),
                 row("large", lake_large, large, med_large)],
        "figures": {
            "lake_events_small": lake_small,
            "lake_events_large": lake_large,
            "median_seconds_small": round(med_small, 4),
            "median_seconds_large": round(med_large, 4),
            "ratio_large_to_small": round(med_large / med_small, 4),
            "runs_small": [t.as_dict() for t in small],
            "runs_large": [t.as_dict() for t in large],
            "setup": {"load_small_seconds": round(load_small, 2), "backfill_small_seconds": round(backfill_small, 2),
                      "load_growth_seconds": round(load_growth, 2),
                      "backfill_growth_seconds": round(backfill_growth, 2)},
        },
        "goals": [Goal("median large / median small", med_large / med_small, "<=", GOAL_RATIO)],
        "notes": [
            f"Each increment: {sizes.increment:,} events on new streams, {EVENTS_PER_NEW_STREAM} per transaction, "
            "then `Extractor.run(SliceRange(0, 1023))` timed end to end (horizon, backlog count, Arrow read, "
            f"Delta append, offset commit); median of {sizes.repeats}. History loaded with `bulk_load` and "
            "VACUUM ANALYZE (as autovacuum would), extracted into the same lake before the increments.",
        ],
    }
