"""state_history: what keeping every state costs beside `stream_state` (issue 45).

The shop's account reducer, once without history (the baseline) and once with `history=True` (every state: the
heaviest grain), on the same lake of the bulk load's accounts (`BENCH_SMALL` events, 50 per stream):

- the first build, by the default path (in this process, forked by core: lake/state/whole_fold.py), timed end to
  end: `stream_state` (and its typed table) without history, then the same with its history table, `stream_state`
  removed between them;
- increments of 1,000 Deposited events, one per existing account (so that every increment closes 1,000 current
  rows of the history and adds 1,000), extracted (not timed), then `update_stream_state` timed end to end:
  a series with history, then the same series without it (the history table then left as it is).

The figures are ratios from one run: the history's own cost (with − without) over `stream_state`'s (without).
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import psycopg
from shop.domain import domain as SHOP

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
from bench.results import Goal, n, ratio, secs
from es_pipeline.domain import Domain
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state.stream_state import update_stream_state

NAME = "state_history"
GOAL_INCREMENT = 1.5
GOAL_FIRST_BUILD = 2.0


def _with_history(history: str | None) -> Domain:
    """The shop's domain, its account reducer keeping `history` (None: none), its cart reducer none."""
    out = copy.copy(SHOP)
    out.reducers = {t: dataclasses.replace(r, history=history if t == "account" else None)
                    for t, r in SHOP.reducers.items()}
    out._folds = None
    return out


WITHOUT, WITH, DAILY = _with_history(None), _with_history("each"), _with_history("daily:UTC")


def _extract(dsn: str, lake: Path, run_id: str) -> int:
    return Extractor(dsn, None, lake, schema=SCHEMA, progress=log.info).run(ALL_SLICES, run_id=run_id).rows


def _deposits(dsn: str, round_no: int, count: int, streams: int) -> None:
    """`count` Deposited events, one on each of `count` existing accounts (the next version of each), one
    transaction; the accounts taken in turn round after round."""
    first = round_no * count % streams
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {SCHEMA}.events (stream_id, stream_type, version, event_type, payload) "
            "SELECT stream_id, 'account', max(version) + 1, 'Deposited', "
            "jsonb_build_object('amount', 1 + %(r)s %% 97) "
            f"FROM {SCHEMA}.events WHERE stream_id = ANY(%(ids)s) GROUP BY stream_id",
            {"r": round_no, "ids": [f"bulk-{(first + k) % streams:08d}" for k in range(count)]})


def _timed(lake: Path, domain: Domain) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = update_stream_state(Engine(), lake, domain=domain)  # the default path needs no Spark here
    return time.perf_counter() - t0, result


def _series(dsn: str, lake: Path, sizes: Sizes, domain: Domain, label: str, first_round: int,
            streams: int) -> list[Timing]:
    out = []
    count = min(sizes.increment, streams)
    for i in range(sizes.repeats):
        _deposits(dsn, first_round + i, count, streams)
        wait_until_extractable(dsn)
        if _extract(dsn, lake, f"bench-history-{label}-{i}") != count:
            raise RuntimeError(f"{label} #{i}: the increment did not reach the lake whole")
        seconds, r = _timed(lake, domain)
        if r.events_folded != count or r.engine != "local":
            raise RuntimeError(f"{label} #{i}: folded {r.events_folded:,} events on {r.engine}")
        out.append(Timing(f"{label} #{i + 1}", r.events_folded, seconds, {"history_rows": r.per("history_rows")}))
        log.info("[%s]   %s increment %d: %.2f s", NAME, label, i + 1, seconds)
    return out


def run(dsn: str, work: Path, sizes: Sizes) -> dict[str, Any]:
    streams = max(1, sizes.small // EVENTS_PER_STREAM)
    log.info("[%s] %s account events over %s streams", NAME, f"{sizes.small:,}", f"{streams:,}")
    load_events(dsn, streams * EVENTS_PER_STREAM, streams)
    wait_until_extractable(dsn)
    lake = work / "lake"
    events = _extract(dsn, lake, "bench-history-load")

    build_without, first = _timed(lake, WITHOUT)
    shutil.rmtree(lake / "stream_state")
    build_daily, daily = _timed(lake, DAILY)  # the grain of the shop's accounts (the bulk load's: one day)
    shutil.rmtree(lake / "stream_state")
    build_with, again = _timed(lake, WITH)
    if first.engine != "local" or again.engine != "local" or not again.per("history_rows"):
        raise RuntimeError(f"the first builds ran on {first.engine} and {again.engine}: not the default path")
    history_rows = again.per("history_rows")["stream_state_account_history"]
    log.info("[%s] first build: %.1f s without history, %.1f s with (%s history rows)", NAME, build_without,
             build_with, f"{history_rows:,}")

    with_history = _series(dsn, lake, sizes, WITH, "with history", 0, streams)
    without = _series(dsn, lake, sizes, WITHOUT, "without history", sizes.repeats, streams)  # history left as is

    med_without = statistics.median(t.seconds for t in without)
    med_with = statistics.median(t.seconds for t in with_history)
    increment_cost = (med_with - med_without) / med_without
    build_cost = (build_with - build_without) / build_without

    def row(label: str, seconds: float, baseline: float, base: bool = False) -> list[str]:
        return [label + (" ← baseline" if base else ""), secs(seconds), ratio(seconds / baseline)]

    return {
        "title": f"state history: its cost beside stream_state, {n(events)} events, 1,000-event increments",
        "parameters": {"events": events, "streams": streams, "increment": min(sizes.increment, streams),
                       "repeats": sizes.repeats,
                       "history_rows_first_build": history_rows},
        "columns": ["update", "seconds (increments: median)", "ratio to without history"],
        "rows": [row("first build, stream_state without history", build_without, build_without, True),
                 row("first build, stream_state + stream_state_account_history, history=\"daily\"", build_daily,
                     build_without),
                 row("first build, stream_state + stream_state_account_history, history=True", build_with,
                     build_without),
                 row("increment, without history", med_without, med_without, True),
                 row("increment, with history (1,000 rows closed, 1,000 added)", med_with, med_without)],
        "figures": {"first_build_seconds_without": round(build_without, 3),
                    "first_build_seconds_daily": round(build_daily, 3),
                    "daily_history_rows": daily.per("history_rows").get("stream_state_account_history", 0),
                    "first_build_seconds_with": round(build_with, 3),
                    "increment_median_seconds_without": round(med_without, 3),
                    "increment_median_seconds_with": round(med_with, 3),
                    "history_increment_cost_over_stream_state": round(increment_cost, 4),
                    "history_first_build_cost_over_stream_state": round(build_cost, 4),
                    "runs_without": [t.as_dict() for t in without], "runs_with": [t.as_dict() for t in with_history]},
        "goals": [Goal("history's increment cost / stream_state's (with − without) / without", increment_cost, "<=",
                       GOAL_INCREMENT),
                  Goal("history's first build cost / stream_state's (with − without) / without", build_cost, "<=",
                       GOAL_FIRST_BUILD)],
        "notes": [
            "Both sides fold with the shop's reducers and keep the typed state tables; only the account reducer's "
            "`history` differs (None, then True: a row per event). Each increment is one Deposited event on each of "
            "1,000 existing accounts, so the history's MERGE closes 1,000 current rows and inserts 1,000 "
            f"(median of {sizes.repeats}; lake/state/history.py). The history's cost is in the fold too (each "
            "state serialized once per event) and in its commit; both are in the 'with' timings. "
            "With history=\"daily\" (the shop's accounts), a day's state is written once the day is over: the bulk "
            "load's events all fall on one day, so its history has a row per account.",
        ],
    }
