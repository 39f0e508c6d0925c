"""pass_cost: what one tailing pass costs, in the extracting process and in PostgreSQL, statement by statement.

`python -m bench.pass_cost [--seconds 60] [--rate 20]`: the tailing loop of an `events` run (extraction/tail.py)
over all 1024 slices, in this process, without Dagster, while make dev's demo writers append `--rate` events/s
from a process of their own. The baseline, measured in the same run, is the same loop for the same time with the
writers stopped: its probes every 2 s, and no pass. Figures: this process's CPU (every thread: delta-rs' and
ADBC's too) per pass, and where PostgreSQL's server has `pg_stat_statements` loaded (`shared_preload_libraries`),
the execution time of each statement the loop sends, per pass; else that part says it was not measured.

Written to bench/results/pass_cost.{json,md}; docs/decisions/0045 quotes it. Not in `make bench`'s list: it is a
piece of `steady_state` and `profile_tail`, measured alone to see a change to the pass at once.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

import psycopg

from bench.common import drop_database, fresh_database, log
from bench.results import machine_facts, write_result
from es_pipeline.extraction.extractor import build_extractor
from es_pipeline.extraction.slices import NUM_SLICES, SliceRange
from es_pipeline.extraction.tail import tail
from es_pipeline.settings import Settings

NAME = "pass_cost"
TITLE = "one tailing pass over 1024 slices: its CPU in the extracting process and in PostgreSQL, by statement"
DATABASE = "bench_pass_cost"
# The writers' own statements, left out of PostgreSQL's figures (they cost the same with or without es_pipeline).
WRITERS = ("es\".events", "es\".streams", "pg_stat_statements")
# Left out of the count too: the writers' (hundreds a minute) cannot be told from the loop's (three a pass).
TRANSACTION_CONTROL = {"BEGIN", "COMMIT", "ROLLBACK", "BEGIN TRANSACTION"}


def _writers(dsn: str, rate: float) -> subprocess.Popen[bytes]:
    code = ("from es_pipeline import EventStore; from es_pipeline.dev.workload import run_workload; "
            f"run_workload(EventStore({dsn!r}), events=None, rollback_rate=0.0, rate={rate}, streams=200, writers=4, "
            "max_commit_delay=0.2)")
    return subprocess.Popen([sys.executable, "-c", code])


def _statements(dsn: str) -> bool:
    """Whether the server counts statements (pg_stat_statements loaded); its counts reset if so."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        loaded = "pg_stat_statements" in str(conn.execute("SHOW shared_preload_libraries").fetchone()[0])  # type: ignore[index]
        if loaded:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")
    return loaded


def _statement_figures(dsn: str) -> list[tuple[str, int, float]]:
    """(statement, calls, ms of execution) of this database's statements but the writers', most costly first."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT regexp_replace(query, '\\s+', ' ', 'g'), calls, total_exec_time FROM pg_stat_statements "
            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "ORDER BY total_exec_time DESC").fetchall()
    return [(str(q), int(c), float(t)) for q, c, t in rows
            if not any(w in q for w in WRITERS) and q.strip().upper() not in TRANSACTION_CONTROL]


def _loop(extractor: Any, seconds: float) -> tuple[float, int, int]:
    """(CPU seconds of this process, passes, rows) of a tailing loop over every slice for `seconds`."""
    every = SliceRange(0, NUM_SLICES - 1)
    with extractor.session(every, "bench") as session:
        extractor.run(every, run_id="bench", session=session)  # the session's first pass: checks, not measured
        cpu = time.process_time()
        out = tail(extractor, every, run_id="bench", seconds=seconds, on_pass=lambda _: None, session=session)
        return time.process_time() - cpu, out.passes, out.rows


def run(seconds: float, rate: float) -> dict[str, Any]:
    dsn = fresh_database(DATABASE)
    try:
        with tempfile.TemporaryDirectory() as warehouse:
            extractor = build_extractor(replace(Settings.from_env(), pg_dsn=dsn, warehouse=warehouse), lambda: None)
            log.info("[pass_cost] baseline: the loop for %.0f s without writers", seconds)
            idle_cpu, _, _ = _loop(extractor, seconds)
            writers = _writers(dsn, rate)
            try:
                time.sleep(3)
                counted = _statements(dsn)
                log.info("[pass_cost] the loop for %.0f s with writers at %.0f events/s", seconds, rate)
                cpu, passes, rows = _loop(extractor, seconds)
                statements = _statement_figures(dsn) if counted else []
            finally:
                writers.terminate()
                writers.wait()
    finally:
        drop_database(DATABASE)
    return {"seconds": seconds, "rate": rate, "idle_cores": idle_cpu / seconds, "cores": cpu / seconds,
            "passes": passes, "rows": rows, "cpu_ms_per_pass": 1000 * (cpu - idle_cpu) / max(passes, 1),
            "statements_counted": counted,
            "pg_ms_per_pass": sum(t for _, _, t in statements) / max(passes, 1) if counted else None,
            "pg_statements_per_pass": sum(c for _, c, _ in statements) / max(passes, 1) if counted else None,
            "statements": [{"statement": q[:200], "calls": c, "ms_per_pass": t / max(passes, 1)}
                           for q, c, t in statements[:15]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=20.0)
    args = parser.parse_args()
    out = run(args.seconds, args.rate)
    rows = [["the loop without writers (baseline: probes only)", f"{out['idle_cores']:.4f}", "", "1.00"],
            [f"the loop with writers: {out['passes']} passes, {out['rows']} events", f"{out['cores']:.4f}",
             f"{out['cpu_ms_per_pass']:.1f}", f"{out['cores'] / max(out['idle_cores'], 1e-9):.2f}"]]
    if out["statements_counted"]:
        rows.append([f"PostgreSQL: {out['pg_statements_per_pass']:.1f} statements a pass, BEGIN/COMMIT aside (execution time)", "",
                     f"{out['pg_ms_per_pass']:.1f}", ""])
        rows += [[f"  `{s['statement'][:110]}` ({s['calls']} calls)", "", f"{s['ms_per_pass']:.2f}", ""]
                 for s in out["statements"]]
    notes = [] if out["statements_counted"] else [
        "PostgreSQL's side not measured: pg_stat_statements is not in the server's shared_preload_libraries."]
    write_result(NAME, title=TITLE, facts=machine_facts(), parameters={"seconds": args.seconds, "rate": args.rate,
                 "slices": NUM_SLICES}, columns=["what", "cores of this process", "ms a pass", "ratio to baseline"],
                 rows=rows, figures=out, goals=[], notes=notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
