"""extract_memory: does a backfill's peak memory stay flat when the backlog doubles?

N events, then 2N events, each into a fresh database and lake, each backfilled by a process of its
own (`bench.backfill_once`), so each peak is clean. Peak = the driver's VmHWM plus the largest
sampled RSS of its children (the Spark JVM). Baseline: the N run; the figure is the ratio 2N / N.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.backfill_once import RESULT_PREFIX
from bench.common import EVENTS_PER_STREAM, PROJECT_ROOT, Sizes, load_events, log, wait_until_extractable
from bench.results import Goal, mib, n, ratio, secs

NAME = "extract_memory"
TITLE = "peak memory of a backfill, N vs 2N events"
GOAL_RATIO = 1.3


def backfill_in_subprocess(dsn: str, warehouse: Path, events: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.backfill_once", "--dsn", dsn, "--warehouse", str(warehouse),
           "--events", str(events)]
    # stderr (progress, Spark's own lines) goes straight through; stdout carries the result line.
    res = subprocess.run(cmd, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True, check=False)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"`{' '.join(cmd[1:4])} ...` failed (exit {res.returncode}):\n{res.stdout[-2000:]}")
    out: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX):])
    return out


def run(fresh_db: Callable[[], str], work: Path, sizes: Sizes) -> dict[str, Any]:
    """`fresh_db()` returns the DSN of an empty, migrated database (the same name each time)."""
    runs: dict[str, dict[str, Any]] = {}
    for label, events in (("N", sizes.events), ("2N", 2 * sizes.events)):
        streams = max(1, events // EVENTS_PER_STREAM)
        dsn = fresh_db()
        log.info("[%s] %s: loading %s events over %s streams", NAME, label, f"{events:,}", f"{streams:,}")
        load_seconds = load_events(dsn, events, streams)
        wait_until_extractable(dsn)
        log.info("[%s] %s: backfill in a subprocess", NAME, label)
        out = backfill_in_subprocess(dsn, work / label, events)
        out["load_seconds"] = round(load_seconds, 2)
        out["streams"] = streams
        runs[label] = out

    base = runs["N"]["total_peak_bytes"]

    def row(label: str, baseline: bool = False) -> list[str]:
        r = runs[label]
        return [label + (" ← baseline" if baseline else ""), n(r["events"]), secs(r["backfill_seconds"]),
                mib(r["python_hwm_bytes"]), mib(r["jvm_peak_rss_bytes"]), mib(r["other_children_peak_rss_bytes"]),
                mib(r["total_peak_bytes"]), ratio(r["total_peak_bytes"] / base)]

    total_ratio = runs["2N"]["total_peak_bytes"] / base
    return {
        "title": TITLE,
        "parameters": {"N": sizes.events, "events_per_stream": EVENTS_PER_STREAM, "sample_interval_s": 0.2},
        "columns": ["backfill", "events", "seconds", "python VmHWM MiB", "JVM peak RSS MiB",
                    "other children MiB", "total peak MiB", "ratio to N"],
        "rows": [row("N", baseline=True), row("2N")],
        "figures": {
            "runs": runs,
            "ratio_total_2n_to_n": round(total_ratio, 4),
            "ratio_python_2n_to_n": round(runs["2N"]["python_hwm_bytes"] / runs["N"]["python_hwm_bytes"], 4),
            "ratio_jvm_2n_to_n": round(runs["2N"]["jvm_peak_rss_bytes"] / max(1, runs["N"]["jvm_peak_rss_bytes"]), 4),
        },
        "goals": [Goal("total peak 2N / N", total_ratio, "<", GOAL_RATIO)],
        "notes": [
            "Each backfill runs in its own process (`python -m bench.backfill_once`): "
            "`Extractor.run(SliceRange(0, 1023))` on a fresh lake with the default writer (delta-rs: no Spark "
            "JVM is started, as in an `events` run). Total peak = the Python process's VmHWM + the largest "
            "total RSS of its descendants sampled every 0.2 s (none with this writer).",
        ],
    }
