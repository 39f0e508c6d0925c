"""small_store: small work stays small (issue 43). A store of a few thousand events, as a new team's first day:
the `events` run of every range with its three checks, then each table's first build, each step timed, in a fresh
process (interpreter, imports and any JVM included), by the engine rule's default (`auto`: in process, no JVM)
against the same process told `ES_PIPELINE_ENGINE=spark` (the baseline: what a JVM costs the same work).

The child process (`python -m bench.small_store <lake> <engine>`, the store's DSN in `ES_PIPELINE_PG_DSN`) prints
its timings as JSON; the parent loads the store once and runs both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import SCHEMA, Timing, load_events, log, wait_until_extractable
from bench.results import Goal, n, ratio, secs
from es_pipeline.extraction import offsets
from es_pipeline.lake.kernel.engine import SPARK_BYTES, Engine

NAME = "small_store"
EVENTS = 3_000
GOAL_SECONDS = 5.0
STEPS = ("events run (every range) and its three checks", "stream_state first build", "stream_catalog first build",
         "event_type_daily first build", "typed event tables first build", "sku_sales (cross-stream) first build")


def run(dsn: str, work: Path) -> dict[str, Any]:
    events = int(os.environ.get("BENCH_SMALL_STORE_EVENTS", EVENTS))
    log.info("[%s] loading %s events", NAME, f"{events:,}")
    load_events(dsn, events, max(1, events // 50))
    wait_until_extractable(dsn)
    found: dict[str, dict[str, float]] = {}
    for engine in ("spark", "auto"):  # the baseline first: each in a fresh process, on a lake of its own
        lake = work / f"lake-{engine}"
        offsets.reset_when_idle(dsn, "events")  # the store's offsets forgotten: this lake is extracted whole
        log.info("[%s] a fresh process, ES_PIPELINE_ENGINE=%s", NAME, engine)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "bench.small_store", str(lake), engine], capture_output=True,
                              text=True, timeout=900, check=False,
                              env={**os.environ, "ES_PIPELINE_PG_DSN": dsn, "ES_PIPELINE_WAREHOUSE": str(lake),
                                   "ES_PIPELINE_ENGINE": engine, "ES_PIPELINE_DOMAIN": "shop.domain"})
        if done.returncode != 0:
            raise RuntimeError(f"the small-store child ({engine}) failed:\n{done.stderr[-3000:]}")
        found[engine] = {**json.loads(done.stdout.strip().splitlines()[-1]),
                         "process, start to end": time.perf_counter() - t0}
    local, spark = found["auto"], found["spark"]
    rows = []
    timings: dict[str, Any] = {}
    for step in (*STEPS, "process, start to end"):
        a, b = local[step], spark[step]
        timings[step] = {"auto": Timing(step, events, a).as_dict(), "spark": Timing(step, events, b).as_dict()}
        rows.append([step, n(events), secs(b), secs(a), ratio(b / a if a else 0.0)])
    worst = max(local[s] for s in STEPS)
    return {
        "title": f"small work stays small: a {events:,}-event store's first day, each step in a fresh process",
        "parameters": {"events": events, "goal_seconds_per_step": GOAL_SECONDS, "cores": os.cpu_count()},
        "columns": ["step", "events", "ES_PIPELINE_ENGINE=spark ← baseline, s", "auto (the rule), s",
                    "times faster"],
        "rows": rows,
        "figures": {"steps": timings, "slowest_step_auto_s": round(worst, 3),
                    "jvm_started_auto": bool(local["jvm"]), "jvm_started_spark": bool(spark["jvm"])},
        "goals": [Goal("slowest step by the rule's default, seconds", worst, "<=", GOAL_SECONDS),
                  Goal("JVMs the default started", float(local["jvm"]), "<=", 0)],
        "notes": [
            "Each engine in a fresh Python process of its own, on a lake of its own over the same store (loaded "
            "once): the extraction of every slice range and the three `events` checks table-wide (no duplicates, "
            "contiguous versions, reconcile with the store), then each table's first build (the shop's domain). "
            f"`auto` is the engine rule's default (size decides: in process within {SPARK_BYTES >> 20} MiB of "
            "`events`' files); "
            "`spark` forces Spark for every step that has a Spark path, the first one starting the local JVM. "
            "The process row is the child's wall time as the parent saw it: its interpreter's start and imports included.",
        ],
    }


def _child(lake: Path, engine: str) -> None:
    from shop.domain import domain as shop

    from es_pipeline import checks
    from es_pipeline.extraction.extractor import extract_ranges
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

    took: dict[str, float] = {}
    t0 = time.perf_counter()
    for _ in extract_ranges(settings, None, spark, run_id="small-store", progress=lambda m: None):
        pass
    given = checks.Given(Engine(engine, spark), lake, dsn, native(SCHEMA))
    for name, result in checks.run(checks.events.CHECKS, given).items():
        if isinstance(result, Exception) or not result.passed:
            raise RuntimeError(f"{name} failed: {result}")
    took[STEPS[0]] = time.perf_counter() - t0
    small = engine != "spark"
    builds = (
        (STEPS[1], lambda: update_stream_state(Engine(spark=spark, small_increments=small), lake, domain=shop)),
        (STEPS[2], lambda: update_stream_catalog(Engine(spark=spark, small_increments=small), lake)),
        (STEPS[3], lambda: update_event_type_daily(Engine(spark=spark, small_increments=small), lake)),
        (STEPS[4], lambda: event_tables.update(lake, shop, engine=Engine(engine, spark))),
        (STEPS[5], lambda: cross_stream.update(lake, shop, "sku_sales", engine=Engine(engine, spark))),
    )
    for step, build in builds:
        t0 = time.perf_counter()
        build()
        took[step] = time.perf_counter() - t0
    from pyspark import SparkContext

    jvm = SparkContext._active_spark_context is not None  # noqa: SLF001 - whether any step started a local JVM
    for session in sessions:
        session.stop()
    print(json.dumps({**took, "jvm": int(jvm)}))


if __name__ == "__main__":
    _child(Path(sys.argv[1]), sys.argv[2])
