"""steady_state: what es_pipeline costs the machine under make dev's trickle, with and without tailing runs.

`python -m bench.steady_state [--quick] [--rate 20]`: three phases of BENCH_STEADY_SECONDS each (default
600, `--quick` 120), each on a fresh store, with the demo writers at `--rate` events/s:
- writers alone (the baseline: their own CPU and the Postgres work of appending);
- the make-dev loop with one pass per run (`ES_PIPELINE_TAIL_SECONDS=0`);
- the same loop with tailing runs (`ES_PIPELINE_TAIL_SECONDS`, default 300);
then the tailing runs under 2,000 events/s for BENCH_KEEP_UP_SECONDS (default 240, `--quick` 120): how
far the lake stays behind the store (sampled every 5 s), and how soon it holds every event once the
writers stop.
The loop is a real Dagster daemon on Postgres storage (8 ranges, the sensor at its default interval, the warm run launcher,
automation on, a Spark Connect server), as `make dev` runs it. Measured: the machine's busy time from
/proc/stat over the phase (so Postgres's work for es_pipeline counts), minus the baseline's, in cores;
Dagster runs created per hour (events runs and the projections'); and whether every event reached the lake.
The hourly jobs are not left to chance in a ten-minute window: their schedules are stopped for it, and each
is run once after it, its added core-seconds counted at a 3600th (`hourly_cost`).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import dagster as dg

from bench.common import admin_dsn, drop_database, fresh_database, log
from bench.results import Goal, machine_facts, write_result
from es_pipeline.dev.stack import dagster_stack
from es_pipeline.dev.workload import run_workload
from es_pipeline.store.event_store import EventStore

NAME = "steady_state"
TITLE = "steady state under a trickle of events: es_pipeline's CPU share and runs per hour"
TAIL_SECONDS = int(os.environ.get("BENCH_TAIL_SECONDS", "300"))
FAST_RATE = 2000.0  # events/s the tailing runs must keep up with


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _busy_cores(seconds: float, during: Any) -> float:
    """Average busy cores while `during()` runs for `seconds`."""
    b0, t0 = _busy_jiffies()
    during(seconds)
    b1, t1 = _busy_jiffies()
    ncpu = os.cpu_count() or 1
    return (b1 - b0) / max(t1 - t0, 1) * ncpu


_PARTS: dict[tuple[int, str], str] = {}  # (pid, start time) → part: a process's command line is read once


def _processes() -> dict[int, tuple[str, int]]:
    """pid → (part, CPU ticks so far) of every process now."""
    out: dict[int, tuple[str, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            key = (int(entry.name), fields[19])
            if key not in _PARTS:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                _PARTS[key] = _part(stat[stat.index("(") + 1:stat.rindex(")")], cmd, int(fields[1]))
        except (OSError, IndexError):
            continue
        out[key[0]] = (_PARTS[key], int(fields[11]) + int(fields[12]))
    return out


def _part(comm: str, cmd: str, ppid: int) -> str:
    if comm == "postgres" or comm.startswith("postgres"):
        return "PostgreSQL"
    if comm == "prometheus":
        return "Prometheus (the operator's)"
    if "es-pipeline metrics" in cmd:
        return "health exporter"
    if comm == "java":
        return "Spark Connect (JVM)"
    if "dagster-daemon" in cmd or "dagster_daemon" in cmd:
        return "Dagster daemon"
    if "es_pipeline.instance.launcher" in cmd:
        return "runs (warm launcher and its forks)"
    if "dagster" in cmd and ("grpc" in cmd or "code-server" in cmd):
        return "Dagster code server"
    if "dagster" in cmd:
        return "Dagster (other)"
    if os.getpid() == int(ppid) or "bench.steady_state" in cmd:
        return "benchmark and demo writers"
    return "other"


class _Sampler:
    """Every process's CPU, sampled every `EVERY` seconds over a phase: a process that ends in the phase
    (a run, a fork) counts up to its last sample, where one sample at each end would lose it whole."""

    EVERY = 2.0

    def __init__(self) -> None:
        self.first = _processes()
        self.last = dict(self.first)

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(self.EVERY, left))
            self.last.update(_processes())

    def cores_by_part(self, seconds: float) -> dict[str, float]:
        """Cores per part over the phase: each process's CPU since the first sample (all of it if it
        started since), up to its last sample."""
        hz = os.sysconf("SC_CLK_TCK")
        parts: dict[str, float] = {}
        for pid, (part, own) in self.last.items():
            _, own0 = self.first.get(pid, (part, 0))
            parts[part] = parts.get(part, 0.0) + max(own - own0, 0) / hz / seconds
        return {k: round(v, 3) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}


def _writers(dsn: str, rate: float) -> tuple[threading.Event, threading.Thread]:
    """The demo writers at `rate` events/s: make dev's four; above 100 events/s eight, with larger transactions."""
    stop = threading.Event()
    shape = (dict(streams=200, writers=4, max_commit_delay=0.2) if rate <= 100
             else dict(streams=2000, writers=8, max_commit_delay=0.02, max_events_per_tx=20))
    thread = threading.Thread(target=run_workload, args=(EventStore(dsn),), kwargs=dict(
        events=None, rollback_rate=0.0, rate=rate, stop=stop, **shape))
    thread.start()
    return stop, thread


def _lake_rows(warehouse: Path) -> int:
    from deltalake import DeltaTable

    path = warehouse / "events"
    return DeltaTable(str(path)).to_pyarrow_dataset().count_rows() if (path / "_delta_log").is_dir() else 0


def _store_rows(dsn: str) -> int:
    import psycopg

    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM es.events").fetchone()
    return int(row[0]) if row else 0


PROJECTIONS = ("stream_state", "stream_catalog", "event_type_daily")


def warm_up(instance: Any, warehouse: Path, limit: float = 300.0) -> float:
    """Until the projections' first builds (Spark, on a cold Connect server: a minute or two) are done and
    no projections run is in progress: that start is not the steady state. Seconds waited (30 at least)."""
    started = time.monotonic()
    time.sleep(30)
    while time.monotonic() - started < limit:
        built = all((warehouse / t / "_delta_log").is_dir() for t in PROJECTIONS)
        busy = instance.get_run_records(dg.RunsFilter(job_name="__ASSET_JOB", statuses=[
            dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED]))
        if built and not busy:
            break
        time.sleep(2)
    return time.monotonic() - started


HOURLY = {"lake_checks_job": "lake_checks_schedule", "delta_maintenance_job": "delta_maintenance_schedule"}


def _dagster(stack: Any, *args: str) -> None:
    """The dagster CLI against the stack's own instance and code server."""
    subprocess.run([str(Path(sys.executable).parent / "dagster"), *args, "-w", str(stack.dagster_home.parent / "workspace.yaml")],
                   env=stack.env, check=True, capture_output=True, timeout=120)


def hourly_off(stack: Any) -> None:
    """The hourly jobs' schedules stopped for the window: whether :07 or :17 falls into ten minutes is
    chance (a third of the time), and a run there would count six times its share of the hour. They
    are measured once instead (`hourly_cost`), their share of an hour added."""
    for schedule in HOURLY.values():
        _dagster(stack, "schedule", "stop", schedule)


def hourly_cost(stack: Any, instance: Any, window_cores: float) -> dict[str, float]:
    """Each hourly job launched once, as its schedule would: the busy core-seconds it added to the window's
    mean (`window_cores`) until its run ended."""
    out = {}
    for job in HOURLY:
        before = {r.dagster_run.run_id for r in instance.get_run_records(dg.RunsFilter(job_name=job))}
        b0, t0 = _busy_jiffies()
        started = time.monotonic()
        _dagster(stack, "job", "launch", "-j", job)
        while time.monotonic() - started < 600:
            runs = [r for r in instance.get_run_records(dg.RunsFilter(job_name=job)) if r.dagster_run.run_id not in before]
            if runs and runs[0].dagster_run.is_finished:
                break
            time.sleep(1)
        else:
            raise RuntimeError(f"{job} did not end within 600 s")
        b1, t1 = _busy_jiffies()
        seconds = time.monotonic() - started
        busy = (b1 - b0) / max(t1 - t0, 1) * (os.cpu_count() or 1) * seconds
        out[job] = round(max(busy - window_cores * seconds, 0.0), 1)
        log.info("[%s] %s: %.0f s, %.1f core-seconds over the window's rate", NAME, job, seconds, out[job])
    return out


@contextmanager
def _loop(dsn: str, rate: float, tail: int) -> Iterator[tuple[Any, dg.DagsterInstance, threading.Event, threading.Thread, float]]:
    """`make dev`'s loop on `dsn` (daemon, sensor at its default interval, automation, runs tailing `tail` s), demo writers at
    `rate`, warmed up: (stack, instance, the writers' stop event and thread, warm-up seconds)."""
    with tempfile.TemporaryDirectory() as tmp, dagster_stack(
        admin_dsn=admin_dsn(), dsn=dsn, tmp=Path(tmp), slice_ranges=8, sensor_interval=None, automation=True,
        extra_env={"ES_PIPELINE_TAIL_SECONDS": str(tail)},
    ) as stack:
        os.environ.update({k: stack.env[k] for k in ("DAGSTER_HOME", "DAGSTER_PG_URL")})
        instance = dg.DagsterInstance.get()
        stop, thread = _writers(dsn, rate)
        try:
            yield stack, instance, stop, thread, warm_up(instance, stack.warehouse)
        finally:
            stop.set()
            thread.join()
            instance.dispose()


def _delivered(warehouse: Path, expected: int, *, timeout: float, poll: float) -> tuple[int, float]:
    """(events in the lake, seconds waited) once it holds `expected`, or after `timeout`."""
    started = time.monotonic()
    while _lake_rows(warehouse) < expected and time.monotonic() - started < timeout:
        time.sleep(poll)
    return _lake_rows(warehouse), time.monotonic() - started


def _run_facts(record: Any) -> dict[str, Any]:
    """What a run in the window was: its job, assets, tags that say why, status and seconds (to attribute cost)."""
    run = record.dagster_run
    ended = record.end_time or time.time()
    return {"job": run.job_name, "assets": sorted(k.to_user_string() for k in (run.asset_selection or ())),
            "status": run.status.value, "seconds": round(ended - (record.start_time or ended), 1),
            "tags": {k: v for k, v in run.tags.items() if k.startswith(("dagster/partition", "dagster/schedule",
                     "dagster/sensor", "dagster/auto", "es_pipeline/"))}}


def phase(label: str, seconds: float, rate: float, tail: int | None,
          beside: Callable[[Any], AbstractContextManager[Any]] | None = None) -> dict[str, Any]:
    """One phase: writers alone (`tail` None), or make dev's loop with runs tailing `tail` s (0: one pass per
    run); `beside(stack)`: what else runs through the window (the health exporter and its Prometheus)."""
    name = f"bench_steady_{label.replace(' ', '_').replace('+', 'and')}"
    dsn = fresh_database(name)
    try:
        if tail is None:
            stop, thread = _writers(dsn, rate)
            cores = _busy_cores(seconds, _Sampler().sleep)  # sampled as the other phases are: its cost cancels
            stop.set()
            thread.join()
            return {"label": label, "busy_cores": cores, "runs": 0, "events": _store_rows(dsn), "delivered": None}
        with _loop(dsn, rate, tail) as (stack, instance, stop, thread, warmup), \
                (beside(stack) if beside is not None else nullcontext()):
            hourly_off(stack)
            time.sleep(30 if beside is not None else 0)  # what runs beside warms up too (its first reading)
            before = len(instance.get_run_records())
            sampler = _Sampler()
            cores = _busy_cores(seconds, sampler.sleep)
            by_part = sampler.cores_by_part(seconds)
            log.info("[%s] %s: cores by part %s", NAME, label, by_part)
            records = instance.get_run_records()
            runs = len(records) - before
            window = [_run_facts(r) for r in records[:runs]]  # newest first: the runs created in the phase
            log.info("[%s] %s: runs %s", NAME, label, window)
            hourly = hourly_cost(stack, instance, cores)
            stop.set()
            thread.join()
            expected = _store_rows(dsn)
            delivered, _ = _delivered(stack.warehouse, expected, timeout=180, poll=1.0)
        return {"label": label, "busy_cores": cores, "runs": runs + len(HOURLY) * seconds / 3600, "events": expected,
                "delivered": delivered, "by_part": by_part, "warmup_s": warmup, "runs_in_window": window,
                "hourly_core_seconds": hourly, "hourly_cores": sum(hourly.values()) / 3600}
    finally:
        drop_database(name)


def keep_up(seconds: float, rate: float) -> dict[str, Any]:
    """Tailing runs under `rate` events/s: how far the lake stays behind the store (sampled every 5 s, in
    seconds of writing), and how long it takes to hold every event once the writers stop."""
    name = "bench_steady_keep_up"
    dsn = fresh_database(name)
    try:
        with _loop(dsn, rate, TAIL_SECONDS) as (stack, _, stop, thread, warmup):
            samples: list[tuple[int, int]] = []  # (events in the store, events in the lake)

            def sample(span: float) -> None:
                end = time.monotonic() + span
                while (left := end - time.monotonic()) > 0:
                    time.sleep(min(5.0, left))
                    samples.append((_store_rows(dsn), _lake_rows(stack.warehouse)))

            first = _store_rows(dsn)
            cores = _busy_cores(seconds, sample)
            stop.set()
            thread.join()
            written = _store_rows(dsn)
            delivered, catch_up = _delivered(stack.warehouse, written, timeout=300, poll=0.5)
        achieved = (written - first) / seconds
        behind = [max(store - lake, 0) / max(achieved, 1.0) for store, lake in samples]
        late = behind[len(behind) // 2:] or [0.0]
        return {"label": f"tailing runs at {rate:,.0f} events/s", "busy_cores": cores, "events": written,
                "delivered": delivered, "achieved_rate": achieved, "warmup_s": warmup, "catch_up_s": catch_up,
                "behind_s_max": max(behind, default=0.0), "behind_s_late_mean": sum(late) / len(late),
                "behind_s": [round(b, 2) for b in behind]}
    finally:
        drop_database(name)


def run(seconds: float, rate: float, keep_up_seconds: float) -> dict[str, Any]:
    alone = phase("writers alone", seconds, rate, None)
    log.info("[%s] writers alone: %.2f busy cores", NAME, alone["busy_cores"])
    one_pass = phase("one pass per run", seconds, rate, 0)
    log.info("[%s] one pass per run: %.2f busy cores, %d runs", NAME, one_pass["busy_cores"], one_pass["runs"])
    tailing = phase("tailing runs", seconds, rate, TAIL_SECONDS)
    log.info("[%s] tailing: %.2f busy cores, %d runs", NAME, tailing["busy_cores"], tailing["runs"])
    fast = keep_up(keep_up_seconds, FAST_RATE)
    log.info("[%s] %s: %.0f events/s written, %.1f s behind late in the phase, caught up %.1f s after the writers "
             "stopped", NAME, fast["label"], fast["achieved_rate"], fast["behind_s_late_mean"], fast["catch_up_s"])
    rows, figures = [], {}
    for p in (alone, one_pass, tailing):
        share = p["busy_cores"] + p.get("hourly_cores", 0.0) - alone["busy_cores"]
        per_hour = p["runs"] * 3600 / seconds
        rows.append([p["label"] + (" ← baseline" if p is alone else ""), f"{p['busy_cores']:.3f}",
                     "—" if p is alone else f"{p['hourly_cores']:.4f}",
                     "—" if p is alone else f"{100 * share:.1f}%", "—" if p is alone else f"{per_hour:,.0f}",
                     f"{p['events']:,}", "—" if p["delivered"] is None else f"{p['delivered']:,}"])
        figures[p["label"]] = {"busy_cores": round(p["busy_cores"], 3), "es_pipeline_cores": round(share, 3),
                               "runs": p["runs"], "runs_per_hour": round(per_hour, 1), "events": p["events"],
                               "delivered": p["delivered"], "cores_by_part": p.get("by_part"),
                               "warmup_s": round(p.get("warmup_s") or 0.0, 1),
                               "runs_in_window": p.get("runs_in_window"),
                               "hourly_core_seconds": p.get("hourly_core_seconds"),
                               "hourly_cores": round(p.get("hourly_cores", 0.0), 4)}
    rows.append([fast["label"], f"{fast['busy_cores']:.3f}", "—", f"{100 * (fast['busy_cores'] - alone['busy_cores']):.0f}%",
                 "—", f"{fast['events']:,}", f"{fast['delivered']:,}"])
    figures[fast["label"]] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in fast.items() if k != "label"}
    tail_share = tailing["busy_cores"] + tailing["hourly_cores"] - alone["busy_cores"]
    return {
        "parameters": {"seconds_per_phase": seconds, "rate_events_per_s": rate, "tail_seconds": TAIL_SECONDS,
                       "slice_ranges": 8, "sensor_interval_s": "default (5 one pass per run, 15 tailing)", "automation": "on", "spark": "Connect server",
                       "keep_up_seconds": keep_up_seconds, "keep_up_rate_events_per_s": FAST_RATE},
        "columns": ["phase", "busy cores in the window", "hourly jobs (cores, over the hour)",
                    "es_pipeline (share of one core)", "runs per hour", "events written",
                    "events in the lake"],
        "rows": rows,
        "figures": figures,
        "by_part": {p["label"]: p["by_part"] for p in (one_pass, tailing)},
        "phases": [one_pass, tailing],
        "goals": [Goal("es_pipeline's share of one core, tailing (issue 47)", tail_share, "<=", 0.05),
                  Goal("runs per hour, tailing", tailing["runs"] * 3600 / seconds, "<=", 120.0),
                  Goal("events in the lake / written, tailing", (tailing["delivered"] or 0) / max(tailing["events"], 1),
                       ">=", 1.0),
                  Goal(f"events written per second, {fast['label']}", fast["achieved_rate"], ">=", 0.95 * FAST_RATE),
                  Goal(f"seconds the lake is behind the store, mean of the second half, {fast['label']}",
                       fast["behind_s_late_mean"], "<", 10.0),
                  Goal(f"seconds to hold every event once the writers stop, {fast['label']}", fast["catch_up_s"],
                       "<", 15.0)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.steady_state", description=TITLE)
    parser.add_argument("--quick", action="store_true", help="120 s per phase instead of 600")
    parser.add_argument("--rate", type=float, default=20.0, help="demo events per second (make dev: 20)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    seconds = float(os.environ.get("BENCH_STEADY_SECONDS", "120" if args.quick else "600"))
    keep_up_seconds = float(os.environ.get("BENCH_KEEP_UP_SECONDS", "120" if args.quick else "240"))
    facts = machine_facts()
    out = run(seconds, args.rate, keep_up_seconds)
    write_result(NAME, title=TITLE, facts=facts, parameters=out["parameters"], columns=out["columns"],
                 rows=out["rows"], figures=out["figures"], goals=out["goals"],
                 notes=["Busy cores: the whole machine's busy time over the phase (/proc/stat), so the Postgres work "
                        "es_pipeline causes counts; es_pipeline's share is a phase's minus the writers-alone phase's. "
                        "Runs: every Dagster run created during the phase (events and projections), and the two hourly "
                        "jobs' share. Hourly jobs (the lake's checks at :07, compaction and vacuum at :17): their schedules "
                        "are stopped for the window, whether one falls into ten minutes being chance; each is launched "
                        "once after it, and the busy core-seconds it adds over the window's rate, divided by 3600, count "
                        "in es_pipeline's share. Each loop phase starts after a warm-up: 30 s, and until the projections' "
                        "first builds (Spark) are done.",
                        *[f"Hourly jobs, {p['label']} (core-seconds, once): " + ", ".join(
                            f"{job} {cs}" for job, cs in (p.get("hourly_core_seconds") or {}).items())
                          for p in out["phases"]],
                        *[f"Where the cores went, {label} (per process over the phase, approximate): " + ", ".join(
                            f"{part} {cores:.3f}" for part, cores in parts.items() if cores >= 0.001)
                          for label, parts in out["by_part"].items()]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
