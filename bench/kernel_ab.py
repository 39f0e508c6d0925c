"""The projection kernel before and after (issue 61, decision 0049): the same work on the code at af65cdb (before the
kernel) and on this tree, in one run.

Setup, once, with this tree: a throwaway store with `BENCH_EVENTS` events, extracted by the real extractor (no
Spark) into a lake; a copy of its `events` as BASE; then `ROUNDS` rounds of new events, each extracted, so that
`events` gets the extractor's own commits. Each version then runs in a child process of its own (`--child`, with
that version's `es_pipeline` first on `sys.path`), from a copy of BASE:
- the first builds, in process: `stream_state`, `stream_catalog`, `event_type_daily`, `sku_sales`, the typed event
  tables, each timed;
- the first half of the rounds' commits, each table's update after each commit (the increments);
- the other half, one `follow` after each commit (a tailing run's pass over every table).
The store's events are accounts in bulk, and a fifth of them carts and accounts written by concurrent writers (the
cross-stream projection `sku_sales` folds the carts'); each round is written by writers too. A commit is replayed by copying its data files, then its log entry: the table sees exactly the extractor's commits,
in order. The children run alternately, `REPEATS` times each; the best time of each figure is kept. Both versions'
tables must end equal (row counts, and `stream_state`'s versions summed), or the benchmark fails.

Figures: seconds per step, before and after, and after / before (`kernel.json`, `kernel.md`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BEFORE = "af65cdb"
NOISE = 1.1  # after / before within 10 %: the same cost
TABLES = ("stream_state", "stream_catalog", "event_type_daily", "sku_sales", "event_tables")


# -- the child: one version's work, its figures as one JSON line ------------------------------------------------------


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    root = spec["root"]
    sys.path.insert(0, root)
    import es_pipeline

    if not str(Path(es_pipeline.__file__).resolve()).startswith(str(Path(root).resolve())):
        raise SystemExit(f"es_pipeline imported from {es_pipeline.__file__}, not from {root}")
    from shop.domain import domain as shop

    from es_pipeline.lake import cross_stream
    from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog
    from es_pipeline.lake.follow import follow
    from es_pipeline.lake.state.stream_state import update_stream_state
    from es_pipeline.lake.typed import event_tables

    try:  # after the kernel: one Engine
        from es_pipeline.lake.kernel.engine import Engine

        here: Any = Engine("local")
        updates = {
            "stream_state": lambda wh: update_stream_state(here, wh, domain=shop),
            "stream_catalog": lambda wh: update_stream_catalog(here, wh),
            "event_type_daily": lambda wh: update_event_type_daily(here, wh),
            "sku_sales": lambda wh: cross_stream.update(wh, shop, "sku_sales", engine=here),
            "event_tables": lambda wh: event_tables.update(wh, shop, engine=here),
        }
    except ImportError:  # before: a session (none) and an engine string
        updates = {
            "stream_state": lambda wh: update_stream_state(None, wh, domain=shop, engine="local"),
            "stream_catalog": lambda wh: update_stream_catalog(None, wh, engine="local"),
            "event_type_daily": lambda wh: update_event_type_daily(None, wh, engine="local"),
            "sku_sales": lambda wh: cross_stream.update(wh, shop, "sku_sales", engine="local"),
            "event_tables": lambda wh: event_tables.update(wh, shop, engine="local"),
        }

    full, warehouse = Path(spec["full"]), Path(spec["warehouse"])
    shutil.rmtree(warehouse, ignore_errors=True)
    shutil.copytree(spec["base"], warehouse / "events")
    figures: dict[str, float] = {}
    for name in TABLES:
        t0 = time.perf_counter()
        updates[name](warehouse)
        figures[f"first build: {name}"] = time.perf_counter() - t0
    commits = spec["commits"]
    half = len(commits) // 2
    for i, version in enumerate(commits):
        _replay(full / "events", warehouse / "events", version)
        if i < half:
            for name in TABLES:
                t0 = time.perf_counter()
                updates[name](warehouse)
                key = f"increments: {name}"
                figures[key] = figures.get(key, 0.0) + time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            follow(warehouse, spec["dsn"], shop, None)
            figures["follow"] = figures.get("follow", 0.0) + time.perf_counter() - t0
    return {"figures": figures, "outputs": _outputs(warehouse), "es_pipeline": es_pipeline.__file__}


def _replay(full: Path, target: Path, version: int) -> None:
    """Commit `version` of the full `events` log onto `target`: its data files first, then its log entry."""
    entry = full / "_delta_log" / f"{version:020d}.json"
    for line in entry.read_text().splitlines():
        action = json.loads(line)
        for kind in ("add", "cdc"):
            if kind in action:
                path = action[kind]["path"]
                (target / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(full / path, target / path)
    shutil.copy2(entry, target / "_delta_log" / entry.name)


def _outputs(warehouse: Path) -> dict[str, int]:
    """Each table's rows, and `stream_state`'s versions summed: what both versions must agree on."""
    from deltalake import DeltaTable

    out = {}
    for name in ("stream_state", "stream_catalog", "event_type_daily", "sku_sales", "event_tables"):
        out[f"{name} rows"] = DeltaTable(str(warehouse / name)).to_pyarrow_table().num_rows
    state = DeltaTable(str(warehouse / "stream_state")).to_pyarrow_table(columns=["version"])
    out["stream_state versions"] = int(sum(v or 0 for v in state["version"].to_pylist()))
    return out


# -- the parent: the store, the lake, the two versions ----------------------------------------------------------------


def _setup(work: Path, events: int, rounds: int, per_round: int) -> tuple[str, list[int]]:
    from bench.common import (
        ALL_SLICES,
        EVENTS_PER_STREAM,
        SCHEMA,
        database_name,
        fresh_database,
        load_events,
        log,
        wait_until_extractable,
    )
    from es_pipeline.dev.workload import run_workload
    from es_pipeline.extraction.extractor import Extractor
    from es_pipeline.store.event_store import EventStore

    dsn = fresh_database(database_name())
    store = EventStore(dsn, SCHEMA)
    carts = events // 5  # carts and accounts by writers (the cross-stream projection's events), the rest in bulk
    log.info("kernel: %s events into the store", f"{events:,}")
    load_events(dsn, events - carts, (events - carts) // EVENTS_PER_STREAM)
    run_workload(store, streams=carts // 20, events=carts, writers=2, rollback_rate=0.05, max_commit_delay=0, seed=61)
    wait_until_extractable(dsn)
    lake = work / "full"
    extractor = Extractor(dsn, None, lake, schema=SCHEMA, progress=log.info)
    extractor.run(ALL_SLICES, run_id="kernel-base")
    shutil.copytree(lake / "events", work / "base" / "events")
    log_dir = lake / "events" / "_delta_log"
    base_last = max(int(p.stem) for p in log_dir.glob("*.json"))
    for r in range(rounds):
        run_workload(store, streams=per_round // 10, events=per_round, writers=2, rollback_rate=0.05,
                     max_commit_delay=0, seed=100 + r)
        wait_until_extractable(dsn)
        extractor.run(ALL_SLICES, run_id=f"kernel-round-{r}")
    commits = sorted(int(p.stem) for p in log_dir.glob("*.json") if int(p.stem) > base_last)
    log.info("kernel: %s commits of `events` after the base, to replay", len(commits))
    return dsn, commits


def _worktree(work: Path) -> Path:
    tree = work / "before"
    if not (tree / "es_pipeline").is_dir():
        subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "worktree", "add", "--detach",
                        str(tree), BEFORE], check=True, capture_output=True)
    return tree


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {spec['label']} child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child")
    parser.add_argument("--keep", action="store_true", help="keep the database and the lakes")
    args = parser.parse_args()
    if args.child:  # before anything imports es_pipeline
        print(json.dumps(_child(json.loads(args.child))), flush=True)
        os._exit(0)  # not the interpreter's teardown: a native pool's threads may abort it after the figures
    from bench.common import WORK_ROOT, database_name, drop_database, log
    from bench.results import Goal, machine_facts, n, ratio, secs, write_result
    events = int(os.environ.get("BENCH_KERNEL_EVENTS") or (5_000 if args.quick else 1_000_000))
    rounds, per_round, repeats = (4, 200, 1) if args.quick else (10, 1_000, 3)
    work = WORK_ROOT / "kernel"
    shutil.rmtree(work / "full", ignore_errors=True)
    shutil.rmtree(work / "base", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    dsn, commits = _setup(work, events, rounds, per_round)
    here = Path(__file__).resolve().parents[1]
    roots = {"before": _worktree(work), "after": here}
    best: dict[str, dict[str, float]] = {"before": {}, "after": {}}
    outputs: dict[str, dict[str, int]] = {}
    try:
        for attempt in range(repeats):
            for label in ("before", "after") if attempt % 2 == 0 else ("after", "before"):
                log.info("kernel: %s, run %s", label, attempt + 1)
                got = _run_child({"label": label, "root": str(roots[label]), "dsn": dsn, "full": str(work / "full"),
                                  "base": str(work / "base" / "events"), "warehouse": str(work / f"lake-{label}"),
                                  "commits": commits})
                outputs[label] = got["outputs"]
                for key, value in got["figures"].items():
                    best[label][key] = min(value, best[label].get(key, value))
    finally:
        subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(roots["before"])],
                       check=False, capture_output=True)
        if not args.keep:
            drop_database(database_name())
            shutil.rmtree(work, ignore_errors=True)
    if outputs["before"] != outputs["after"]:
        raise SystemExit(f"the versions' tables differ: before {outputs['before']}, after {outputs['after']}")
    half = len(commits) // 2
    rows = []
    figures: dict[str, Any] = {}
    for key in best["before"]:
        b, a = best["before"][key], best["after"][key]
        rows.append([key, secs(b), secs(a), ratio(a / b)])
        figures[key] = {"before_s": round(b, 3), "after_s": round(a, 3), "after_over_before": round(a / b, 3)}
    def total(label: str, prefix: str) -> float:
        return sum(v for k, v in best[label].items() if k.startswith(prefix))

    goals = [Goal(f"{what}: after / before", total("after", prefix) / total("before", prefix), "<=", NOISE)
             for what, prefix in (("first builds", "first build"), ("increments", "increments"), ("follow", "follow"))]
    write_result(
        "kernel", title="The projection kernel: the same work before (af65cdb) and after, in one run",
        facts=machine_facts(),
        parameters={"events": events, "commits_replayed": len(commits), "increments": half,
                    "follows": len(commits) - half, "events_per_round": per_round, "repeats": repeats,
                    "benchmark_seconds": round(time.monotonic() - started, 1)},
        figures={**figures, "tables_equal": outputs["after"]},
        columns=["step (in process, no Spark)", "before", "after", "after / before"], rows=rows, goals=goals,
        notes=[f"Both versions' tables end equal: {', '.join(f'{k} {n(v)}' for k, v in outputs['after'].items())}.",
               "Each figure is the best of the runs; the goals compare each group's total (noise: 10 %)."],
    )

if __name__ == "__main__":
    main()
