"""exporter_cost: what the health exporter adds to the steady state, scraped by a real Prometheus every 10 s.

`python -m bench.exporter_cost [--quick] [--rate 20]`: three phases of BENCH_STEADY_SECONDS each (default 600,
`--quick` 180), each on a fresh store with the demo writers at `--rate` events/s, measured as bench.steady_state
measures (the machine's busy time from /proc/stat, per process where it went):
- writers alone (the baseline);
- make dev's loop with tailing runs (as steady_state's third phase);
- the same loop with `es-pipeline metrics` running beside it and a Prometheus server (Debian's) scraping it every
  10 s and evaluating es_pipeline's alert rules, as `make dev` runs them.
es_pipeline's share of a core with the exporter is the third phase minus the baseline, without Prometheus's own
CPU (the operator's server, which scrapes whatever else it scrapes too); the exporter's own process is shown too.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.results import Goal, machine_facts, write_result
from bench.steady_state import TAIL_SECONDS, phase
from es_pipeline.dev.stack import free_port, wait_port
from es_pipeline.health.prometheus import prometheus

NAME = "exporter_cost"
TITLE = "the health exporter beside the steady state, scraped by Prometheus every 10 s: es_pipeline's CPU share"
SCRAPE = "10s"
PROMETHEUS = "Prometheus (the operator's)"
EXPORTER = "health exporter"


@contextmanager
def exporter_and_prometheus(stack: Any) -> Iterator[None]:
    """`es-pipeline metrics` over the stack's store, lake and instance, and a Prometheus scraping it."""
    port = free_port()
    cli = str(Path(sys.executable).parent / "es-pipeline")
    with tempfile.TemporaryDirectory() as tmp:
        exporter = subprocess.Popen([cli, "metrics", "--port", str(port)], env=stack.env,
                                    stdout=open(Path(tmp) / "exporter.log", "wb"), stderr=subprocess.STDOUT)
        try:
            wait_port(port, 60)
            with prometheus([f"127.0.0.1:{port}"], Path(tmp) / "prometheus", port=free_port(), interval=SCRAPE):
                yield
        finally:
            exporter.terminate()
            exporter.wait(30)


def run(seconds: float, rate: float) -> dict[str, Any]:
    alone = phase("writers alone", seconds, rate, None)
    tailing = phase("tailing runs", seconds, rate, TAIL_SECONDS)
    watched = phase("tailing runs + exporter", seconds, rate, TAIL_SECONDS, beside=exporter_and_prometheus)
    rows, figures = [], {}
    for p in (alone, tailing, watched):
        prom = (p.get("by_part") or {}).get(PROMETHEUS, 0.0)
        share = p["busy_cores"] + p.get("hourly_cores", 0.0) - prom - alone["busy_cores"]
        p["share"] = share
        rows.append([p["label"] + (" ← baseline" if p is alone else ""), f"{p['busy_cores']:.3f}",
                     "—" if p is alone else f"{prom:.3f}",
                     "—" if p is alone else f"{(p.get('by_part') or {}).get(EXPORTER, 0.0):.3f}",
                     "—" if p is alone else f"{100 * share:.1f}%",
                     f"{p['events']:,}", "—" if p["delivered"] is None else f"{p['delivered']:,}"])
        figures[p["label"]] = {"busy_cores": round(p["busy_cores"], 3), "es_pipeline_cores": round(share, 3),
                               "prometheus_cores": prom, "cores_by_part": p.get("by_part"), "events": p["events"],
                               "delivered": p["delivered"], "hourly_cores": round(p.get("hourly_cores", 0.0), 4)}
    exporter_own = (watched.get("by_part") or {}).get(EXPORTER, 0.0)
    return {
        "parameters": {"seconds_per_phase": seconds, "rate_events_per_s": rate, "tail_seconds": TAIL_SECONDS,
                       "scrape_and_evaluation_interval": SCRAPE, "slice_ranges": 8, "automation": "on"},
        "columns": ["phase", "busy cores in the window", "Prometheus (cores)", "exporter process (cores)",
                    "es_pipeline (share of one core)", "events written", "events in the lake"],
        "rows": rows, "figures": figures,
        "by_part": {p["label"]: p["by_part"] for p in (tailing, watched)},
        "goals": [Goal("es_pipeline's share of one core, tailing runs with the exporter (issue 47)", watched["share"], "<=", 0.05),
                  Goal("the exporter process's share of one core", exporter_own, "<=", 0.02),
                  Goal("events in the lake / written, with the exporter",
                       (watched["delivered"] or 0) / max(watched["events"], 1), ">=", 1.0)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.exporter_cost", description=TITLE)
    parser.add_argument("--quick", action="store_true", help="180 s per phase instead of 600")
    parser.add_argument("--rate", type=float, default=20.0, help="demo events per second (make dev: 20)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    seconds = float(os.environ.get("BENCH_STEADY_SECONDS", "180" if args.quick else "600"))
    facts = machine_facts()
    out = run(seconds, args.rate)
    write_result(NAME, title=TITLE, facts=facts, parameters=out["parameters"], columns=out["columns"],
                 rows=out["rows"], figures=out["figures"], goals=out["goals"],
                 notes=["Measured as bench.steady_state measures (its notes say how); each phase on a fresh store. "
                        "es_pipeline's share: a phase's busy cores, plus its hourly jobs' share, minus Prometheus's "
                        "own CPU, minus the writers-alone phase's. The exporter's reading is taken on each scrape (every "
                        "10 s), reused for 5 s; the first one (3 s of imports) falls in the 30 s before the window.",
                        *[f"Where the cores went, {label} (per process over the phase, approximate): " + ", ".join(
                            f"{part} {cores:.3f}" for part, cores in parts.items() if cores >= 0.001)
                          for label, parts in out["by_part"].items()]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
