"""table_memory: does each table's first build hold its memory flat when `events` doubles? (issue 43)

N events, then 2N, each into a fresh database and lake (extracted by this process). Then each table's first
build (and the `events` checks table-wide) in a fresh process of its own (`python -m bench.table_memory <lake>
<step>`), by the engine rule's default (`auto`), which says in the result where it ran. Peak = the largest total
PSS of the child and its descendants at one instant (forked folds, a local Spark JVM and its Python workers),
sampled every 0.1 s, above the child's PSS when idle (after its imports, before the build): PSS counts each
physical page once where RSS sums count a fork's inherited pages in every fork (that sum is shown beside).
Baseline: the N run; the figure is 2N / N per step (goal <= 1.3).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    EVENTS_PER_STREAM,
    PROJECT_ROOT,
    SCHEMA,
    Sizes,
    load_events,
    log,
    wait_until_extractable,
)
from bench.results import Goal, mib, ratio, secs
from es_pipeline.lake.kernel.engine import Engine

NAME = "table_memory"
TITLE = "peak memory of each table's first build, N vs 2N events"
GOAL_RATIO = 1.3
LARGE = "table_memory_50m"  # one run at BENCH_HUGE events (50M), every table built: the peak under a ceiling
LARGE_EVENTS = 50_000_000
LARGE_CEILING = 6 * 1024**3
STEPS = ("events checks (table-wide)", "stream_state", "stream_catalog", "event_type_daily", "typed event tables",
         "moved_by_amount (cross-stream)")


def run(fresh_db: Callable[[], str], work: Path, sizes: Sizes) -> dict[str, Any]:
    """`fresh_db()` returns the DSN of an empty, migrated database (the same name each time)."""
    from bench.state import _extract

    runs: dict[str, dict[str, Any]] = {}
    for label, events in (("N", sizes.events), ("2N", 2 * sizes.events)):
        streams = max(1, events // EVENTS_PER_STREAM)
        dsn = fresh_db()
        log.info("[%s] %s: loading %s events over %s streams", NAME, label, f"{events:,}", f"{streams:,}")
        load_events(dsn, events, streams)
        wait_until_extractable(dsn)
        lake_root = work / label
        moved = _extract(dsn, lake_root, f"table-memory-{label}")
        if moved != events:
            raise RuntimeError(f"the extraction moved {moved:,} of {events:,} events")
        runs[label] = {"events": events, "steps": {}}
        for step in STEPS:
            log.info("[%s] %s: %s in a fresh process", NAME, label, step)
            runs[label]["steps"][step] = _child_run(dsn, lake_root / "lake", step)

    rows, goals, ratios = [], [], {}
    for step in STEPS:
        a, b = runs["N"]["steps"][step], runs["2N"]["steps"][step]
        r = b["peak_bytes"] / max(1, a["peak_bytes"])
        ratios[step] = round(r, 4)
        rows.append([step, a["engine"], mib(a["peak_bytes"]), mib(a["rss_peak_bytes"]), secs(a["seconds"]), b["engine"],
                     mib(b["peak_bytes"]), mib(b["rss_peak_bytes"]), secs(b["seconds"]), ratio(r)])
        goals.append(Goal(f"{step}: peak 2N / N", r, "<=", GOAL_RATIO))
    return {
        "title": TITLE,
        "parameters": {"N": sizes.events, "events_per_stream": EVENTS_PER_STREAM, "sample_interval_s": 0.1,
                       "cores": os.cpu_count()},
        "columns": ["first build", "engine at N", "peak MiB at N ← baseline", "RSS sum MiB at N", "s at N",
                    "engine at 2N", "peak MiB at 2N", "RSS sum MiB at 2N", "s at 2N", "2N / N"],
        "rows": rows,
        "figures": {"runs": runs, "ratios_2n_to_n": ratios},
        "goals": goals,
        "notes": [
            "Each step in a fresh Python process over the lake extracted from the store (N = "
            f"{sizes.events:,} events, 2N = {2 * sizes.events:,}; {EVENTS_PER_STREAM} events per stream), the "
            "engine chosen by the rule's default (`auto`). Peak = the largest total PSS (proportional set size, "
            "/proc/<pid>/smaps_rollup) of the process and all its descendants at one instant (forked folds, a local "
            "Spark JVM and its Python workers), sampled every 0.1 s, less the process's PSS when idle (imports done, "
            "nothing read): every physical page counted once. The RSS sum beside it (the process's VmHWM above its "
            "idle RSS + the largest RSS total of its descendants) counts a fork's inherited copy-on-write pages "
            "again in each fork: shown, not the goal. The checks are the three `events` checks "
            "table-wide; the cross-stream projection folds two event types by a payload key (bench/state.py).",
        ],
    }


def run_large(fresh_db: Callable[[], str], work: Path, events: int) -> dict[str, Any]:
    """Every table's first build over one lake of `events` (default 50M), each in a fresh process; goal: each peak
    under `LARGE_CEILING` (6 GiB) summed over the process tree, by whatever engine the rule picks."""
    from bench.state import _extract

    streams = max(1, events // EVENTS_PER_STREAM)
    dsn = fresh_db()
    log.info("[%s] loading %s events over %s streams", LARGE, f"{events:,}", f"{streams:,}")
    load_seconds = load_events(dsn, events, streams)
    wait_until_extractable(dsn)
    t0 = time.perf_counter()
    moved = _extract(dsn, work, "table-memory-large")
    extract_seconds = time.perf_counter() - t0
    if moved != events:
        raise RuntimeError(f"the extraction moved {moved:,} of {events:,} events")
    steps = {}
    for step in STEPS:
        log.info("[%s] %s in a fresh process", LARGE, step)
        steps[step] = _child_run(dsn, work / "lake", step)
    rows = [[step, r["engine"], mib(r["peak_bytes"]), mib(r["rss_peak_bytes"]), mib(r["jvm_peak_rss_bytes"]),
             secs(r["seconds"]), ratio(r["peak_bytes"] / LARGE_CEILING)] for step, r in steps.items()]
    return {
        "title": f"peak memory of every table's first build at {events:,} events",
        "parameters": {"events": events, "events_per_stream": EVENTS_PER_STREAM, "sample_interval_s": 0.1,
                       "cores": os.cpu_count(), "load_seconds": round(load_seconds, 1),
                       "extract_seconds": round(extract_seconds, 1)},
        "columns": ["first build", "engine", "peak MiB (PSS, tree)", "RSS sum MiB", "JVM peak RSS MiB", "seconds",
                    "peak / 6 GiB ← baseline"],
        "rows": rows,
        "figures": {"steps": steps},
        "goals": [Goal(f"{step}: peak, GiB", r["peak_bytes"] / 1024**3, "<", LARGE_CEILING / 1024**3)
                  for step, r in steps.items()],
        "notes": [
            f"One store of {events:,} events ({EVENTS_PER_STREAM} per stream), extracted once; each step in a fresh "
            "process as in table_memory (peak = PSS summed over the process tree, above the idle process), by the "
            "engine rule's default: past its bound (1 GiB of `events`' Parquet) the work goes to a local Spark "
            "session (`local[2]`, driver memory 4g), whose JVM and Python workers are in the tree.",
        ],
    }


def _child_run(dsn: str, lake: Path, step: str) -> dict[str, Any]:
    env = {**os.environ, "ES_PIPELINE_PG_DSN": dsn, "ES_PIPELINE_WAREHOUSE": str(lake), "ES_PIPELINE_ENGINE": "auto"}
    done = subprocess.run([sys.executable, "-m", "bench.table_memory", str(lake), step], cwd=PROJECT_ROOT,
                          stdout=subprocess.PIPE, text=True, timeout=3600, check=False, env=env)
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"the table_memory child ({step}) failed (exit {done.returncode})")
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def _child(lake: Path, step: str) -> None:
    from shop.domain import domain as shop

    from bench.procmem import ChildrenSampler, pss_kib, status_kib
    from bench.state import MOVED
    from es_pipeline import checks
    from es_pipeline.extraction.extractor import Extractor
    from es_pipeline.extraction.offsets import batch_frontier
    from es_pipeline.lake import cross_stream
    from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog
    from es_pipeline.lake.spark import get_spark
    from es_pipeline.lake.state.stream_state import update_stream_state
    from es_pipeline.lake.typed import event_tables
    from es_pipeline.settings import Settings
    from es_pipeline.source.mapping import native

    settings = Settings.from_env()
    dsn = settings.pg_dsn
    sessions: list[Any] = []

    def spark() -> Any:
        if not sessions:
            sessions.append(get_spark(settings))
        return sessions[0]

    def run_checks() -> str:
        given = checks.Given(Engine("auto", spark), lake, dsn, native(SCHEMA))
        engines = set()
        for name, result in checks.run(checks.events.CHECKS, given).items():
            if isinstance(result, Exception) or not result.passed:
                raise RuntimeError(f"{name} failed: {result}")
            engines.add(str(result.metadata["engine"]))
        return "+".join(sorted(engines))

    def moved() -> Any:
        consumer = Extractor(dsn, None, lake, schema=SCHEMA).consumer
        return cross_stream.update(lake, MOVED, "moved_by_amount", store_dsn=dsn, engine=Engine("auto", spark),
                                   frontier=lambda: batch_frontier(dsn, consumer))

    builds: dict[str, Callable[[], Any]] = {
        STEPS[0]: run_checks,
        STEPS[1]: lambda: update_stream_state(Engine(spark=spark), lake, domain=shop),
        STEPS[2]: lambda: update_stream_catalog(Engine(spark=spark), lake),
        STEPS[3]: lambda: update_event_type_daily(Engine(spark=spark), lake),
        STEPS[4]: lambda: event_tables.update(lake, shop, engine=Engine("auto", spark)),
        STEPS[5]: moved,
    }
    idle, idle_pss = status_kib(os.getpid(), "VmRSS"), pss_kib(os.getpid())
    sampler = ChildrenSampler(interval=0.1).start()
    t0 = time.perf_counter()
    result = builds[step]()
    seconds = time.perf_counter() - t0
    peaks = sampler.stop()
    hwm = status_kib(os.getpid(), "VmHWM")
    engine = result if isinstance(result, str) else str(getattr(result, "engine", "") or "")
    print(json.dumps({
        "engine": engine or "in process", "seconds": round(seconds, 3), "idle_rss_bytes": idle * 1024,
        "python_hwm_bytes": hwm * 1024, "jvm_peak_rss_bytes": peaks.jvm_kib * 1024,
        "children_peak_rss_bytes": peaks.children_kib * 1024,
        "rss_peak_bytes": (max(0, hwm - idle) + peaks.children_kib) * 1024,
        "idle_pss_bytes": idle_pss * 1024, "tree_pss_peak_bytes": peaks.tree_pss_kib * 1024,
        "peak_bytes": max(0, peaks.tree_pss_kib - idle_pss) * 1024,
    }))
    for session in sessions:
        session.stop()


if __name__ == "__main__":
    _child(Path(sys.argv[1]), sys.argv[2])
