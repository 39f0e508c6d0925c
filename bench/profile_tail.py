"""profile_tail: where the steady state's CPU goes, by process and by function, sampled with py-spy.

`python -m bench.profile_tail [--seconds 180] [--rate 20]`: make dev's loop (bench.steady_state's tailing phase:
a Dagster daemon on Postgres storage, 8 ranges, automation on, tailing runs, the warm run launcher, a Spark
Connect server) with the demo writers at `--rate` events/s and the health exporter scraped by a real
Prometheus every 10 s (bench.exporter_cost's set-up). After the warm-up, py-spy samples every Python process of
es_pipeline for the window (the warm launcher and the runs it forks, the daemon, the code server, the exporter)
at 100 Hz, on-CPU stacks only; /proc says each process's CPU over the same window.

Written to bench/results/profile_tail.{json,md}: per process its cores and its top functions by samples (own
time, and inclusive time of es_pipeline's, Dagster's and the libraries' named steps: the probe, the read, the
Delta commit, each projection's increment, the reports to Dagster, the exporter's reading), the numbers
docs/decisions/0045 quotes.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import drop_database, fresh_database, log
from bench.exporter_cost import exporter_and_prometheus
from bench.results import machine_facts, write_result
from bench.steady_state import TAIL_SECONDS, _loop, _processes, hourly_off

NAME = "profile_tail"
TITLE = "the steady state's CPU by process and function (py-spy), tailing runs at 20 events/s with the exporter"
RATE_HZ = 100

# Inclusive steps worth naming: a frame whose function (or module:function) contains the key.
STEPS = {
    "probe (the sensor's and the tail's)": ("probe (es_pipeline/extraction/probe.py",),
    "extraction pass (Extractor.run)": ("run (es_pipeline/extraction/extractor.py",),
    "read from the store (ADBC/Arrow)": ("es_pipeline/extraction/reader.py",),
    "Delta commit of events (delta-rs)": ("es_pipeline/lake/delta/arrow_append.py", "es_pipeline/lake/events.py"),
    "offsets (pending, watermarks)": ("es_pipeline/extraction/offsets.py",),
    "waiting for commits (LISTEN)": ("wait_for_commits",),
    "projections follow (all)": ("follow (es_pipeline/lake/follow.py",),
    "stream_state increment": ("small_increment (es_pipeline/lake/state/stream_state.py",),
    "typed state": ("with_typed_state", "es_pipeline/lake/state/typed_state.py"),
    "aggregates increment": ("es_pipeline/lake/aggregates/aggregate.py",),
    "cross-stream increment": ("increment (es_pipeline/lake/cross_stream.py",),
    "typed event tables increment": ("increment (es_pipeline/lake/typed/event_tables.py",),
    "change feed read (Feed)": ("es_pipeline/lake/kernel/feed.py",),
    "reports to Dagster (log_event, materializations)": ("log_event (", "report_runless_asset_event", "store_event ("),
    "Dagster storage writes (event log)": ("dagster_postgres/event_log", "dagster/_core/storage/event_log"),
    "sensor ticks": ("evaluate_tick", "_evaluate_sensor", "sensor_daemon"),
    "automation (asset daemon)": ("asset_daemon", "AutomationCondition", "automation_condition"),
    "run queue (dequeue)": ("queued_run_coordinator_daemon", "dequeue"),
    "run monitoring": ("monitoring_daemon", "run_monitoring"),
    "freshness daemon": ("freshness",),
    "gRPC (code server calls)": ("grpc/",),
    "exporter reading": ("_take (es_pipeline/health/exporter.py",),
    "exporter: Dagster reading": ("read_dagster",),
    "exporter: the lake (Delta logs)": ("es_pipeline/lake/read/behind.py",),
    "exporter: the store": ("read_store",),
}


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy is missing: `uv sync --extra bench` installs it")
    return found


def _targets() -> dict[str, list[int]]:
    """Processes to sample, by part: the top of each tree (py-spy follows its subprocesses)."""
    parts: dict[str, list[int]] = {}
    for pid, (part, _) in _processes().items():
        if part in ("runs (warm launcher and its forks)", "Dagster daemon", "Dagster code server", "health exporter"):
            parts.setdefault(part, []).append(pid)
    return parts


def _ppid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[1])
    except (OSError, ValueError):
        return 0


def _roots(pids: list[int]) -> list[int]:
    """The pids whose parent is not in the list (py-spy's --subprocesses takes the rest)."""
    within = set(pids)
    return [p for p in pids if _ppid(p) not in within]


def sample(seconds: float, out: Path) -> dict[str, Any]:
    spy = _py_spy()
    procs, files = [], {}
    for part, pids in _targets().items():
        for pid in _roots(pids):
            file = out / f"sampled-{len(files)}.txt"  # a name no part of _part() matches: py-spy is itself
            files[file] = part
            # The daemon's children are the warm launcher and its runs, sampled on their own.
            children = [] if part == "Dagster daemon" else ["--subprocesses"]
            procs.append(subprocess.Popen(
                [spy, "record", "--pid", str(pid), *children, "--nonblocking", "--rate", str(RATE_HZ),
                 "--duration", str(int(seconds)), "--format", "raw", "--output", str(file)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    before = _processes()
    time.sleep(seconds)
    after = _processes()
    for p in procs:
        p.wait(timeout=120)
    hz = os.sysconf("SC_CLK_TCK")
    cores: Counter[str] = Counter()
    spies = {p.pid for p in procs}
    for pid, (part, ticks) in after.items():
        label = "py-spy (the profiler itself)" if pid in spies else part
        cores[label] += max(ticks - before.get(pid, (part, 0))[1], 0) / hz / seconds
    by_part: dict[str, dict[str, Any]] = {}
    for file, part in files.items():
        if not file.exists():
            continue
        entry = by_part.setdefault(part, {"samples": 0, "own": Counter(), "steps": Counter(), "stacks": Counter()})
        for line in file.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            entry["samples"] += n
            entry["own"][_short(frames[-1])] += n
            for step, keys in STEPS.items():
                if any(any(k in f for k in keys) for f in frames):
                    entry["steps"][step] += n
    return {"cores": {k: round(v, 4) for k, v in cores.most_common()}, "parts": by_part}


def _short(frame: str) -> str:
    """`function (path/to/package/module.py:line)` → `function [package.module]`: the same function's lines together."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0].removesuffix(".py")
    return f"{name} [{'.'.join(path.split('/')[-2:])}]"


def run(seconds: float, rate: float) -> dict[str, Any]:
    name = "bench_profile_tail"
    dsn = fresh_database(name)
    try:
        with _loop(dsn, rate, TAIL_SECONDS) as (stack, _, stop, thread, warmup), exporter_and_prometheus(stack), \
                tempfile.TemporaryDirectory() as tmp:
            hourly_off(stack)
            time.sleep(30)  # the exporter's first readings
            log.info("[%s] warmed up in %.0f s; sampling %.0f s", NAME, warmup, seconds)
            found = sample(seconds, Path(tmp))
            stop.set()
            thread.join()
    finally:
        drop_database(name)
    rows = []
    figures: dict[str, Any] = {"cores_by_process": found["cores"], "processes": {}}
    for part, entry in sorted(found["parts"].items(), key=lambda kv: -kv[1]["samples"]):
        total = max(entry["samples"], 1)
        cores = found["cores"].get(part, 0.0)
        own = [(f, n) for f, n in entry["own"].most_common(15)]
        steps = [(s, n) for s, n in entry["steps"].most_common() if n / total >= 0.01]
        figures["processes"][part] = {"cores": cores, "samples": entry["samples"],
                                      "steps": {s: round(n / total, 3) for s, n in steps},
                                      "top_own": {f: round(n / total, 3) for f, n in own}}
        for step, n in steps:
            rows.append([part, f"{cores:.3f}", step, f"{100 * n / total:.0f}%", f"{cores * n / total:.4f}"])
    notes = ["Cores per process over the window (/proc): " + ", ".join(
        f"{p} {c:.3f}" for p, c in found["cores"].items() if c >= 0.001)]
    for part, facts in figures["processes"].items():
        notes.append(f"Top functions by own samples, {part}: " + "; ".join(
            f"{f} {100 * share:.0f}%" for f, share in list(facts["top_own"].items())[:10]))
    return {"parameters": {"seconds": seconds, "rate_events_per_s": rate, "tail_seconds": TAIL_SECONDS,
                           "py_spy_hz": RATE_HZ, "exporter": "scraped every 10 s by Prometheus", "slice_ranges": 8},
            "columns": ["process", "its cores", "step (inclusive)", "share of its samples", "cores (approx.)"],
            "rows": rows, "figures": figures, "notes": notes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_tail", description=TITLE)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--rate", type=float, default=20.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    facts = machine_facts()
    out = run(args.seconds, args.rate)
    write_result(NAME, title=TITLE, facts=facts, parameters=out["parameters"], columns=out["columns"],
                 rows=out["rows"], figures=out["figures"], goals=[], notes=out["notes"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
