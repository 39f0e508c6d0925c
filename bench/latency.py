"""Commit-to-lake latency through the real loop, and the sensor's tick cost vs table size.

`python -m bench.latency [--commits 60] [--only latency|sensor_tick]`

latency: a Dagster daemon (default settings: 8 ranges, sensor every 5 s, runs on a shared Spark
Connect server) over Postgres storage, a background demo load, and one probe commit per second.
For each probe event: commit time (after COMMIT returns), the run that extracted it (the first
run of its range whose horizon passed its tx_id), that run's Dagster timestamps, its metadata,
and the moment the event became visible in the Delta table (polled every 0.25 s with delta-rs).
sensor_tick: the sensor's one-statement probe, median of 20, with 100 thousand vs 10 million
events in the store (BENCH_TICK_SMALL / BENCH_TICK_LARGE override).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg

from bench.common import admin_dsn, drop_database, fresh_database
from bench.results import Goal, machine_facts, write_result
from es_pipeline.demo import bulk_load, run_workload
from es_pipeline.event_store import EventStore, NewEvent
from es_pipeline.pg import connect
from es_pipeline.sensing import probe
from es_pipeline_tests.e2e import dagster_stack


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _lake_seen(path: Path, seen: dict[tuple[str, int], float], stop: threading.Event) -> None:
    from deltalake import DeltaTable
    from deltalake.exceptions import DeltaError, TableNotFoundError

    last = -1
    while not stop.is_set():
        if (path / "_delta_log").is_dir():
            try:
                dt = DeltaTable(str(path))
                if dt.version() != last:
                    last = dt.version()
                    now = time.time()
                    t = dt.to_pyarrow_table(columns=["stream_id", "version"])
                    for k in zip(t.column("stream_id").to_pylist(), t.column("version").to_pylist(), strict=True):
                        seen.setdefault(k, now)
            except (OSError, DeltaError, TableNotFoundError):
                pass  # the log is being created or a commit is half-written: look again
        time.sleep(0.25)


def latency(commits: int) -> None:
    db = "bench_latency"
    dsn = fresh_database(db)
    store = EventStore(dsn)
    try:
        with tempfile.TemporaryDirectory(dir=Path("bench") / "work" if Path("bench/work").exists() else None) as tmp, \
                dagster_stack(admin_dsn=admin_dsn(), dsn=dsn, tmp=Path(tmp), slice_ranges=8, sensor_interval=5) as stack:
            os.environ["DAGSTER_HOME"], os.environ["DAGSTER_PG_URL"] = stack.env["DAGSTER_HOME"], stack.env["DAGSTER_PG_URL"]
            instance = dg.DagsterInstance.get()
            seen: dict[tuple[str, int], float] = {}
            stop = threading.Event()
            poller = threading.Thread(target=_lake_seen, args=(stack.warehouse / "events", seen, stop), daemon=True)
            poller.start()
            background = threading.Thread(target=run_workload, args=(store,), kwargs=dict(
                streams=200, events=None, writers=2, rollback_rate=0.1, max_commit_delay=0.1, rate=10.0, stop=stop),
                daemon=True)
            background.start()
            # Warm-up: the first run of each range attaches to a cold Spark server.
            store.append("warmup", "cart", [NewEvent("ItemAdded", {"sku": "w"})], 0)
            deadline = time.monotonic() + 300
            while ("warmup", 1) not in seen and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(20)
            probes: list[tuple[str, int, float, int]] = []
            for i in range(commits):
                sid = f"probe-{i}"
                with store.connect() as conn:
                    with conn.transaction():
                        store.append(sid, "cart", [NewEvent("ItemAdded", {"sku": "p", "qty": 1})], 0, conn=conn)
                        row = conn.execute("SELECT pg_current_xact_id()::text::bigint, es.slice_of(%s)", (sid,)).fetchone()
                    assert row is not None
                    probes.append((sid, int(row[0]), time.time(), int(row[1])))
                time.sleep(1.0)
            deadline = time.monotonic() + 180
            while any((p[0], 1) not in seen for p in probes) and time.monotonic() < deadline:
                time.sleep(0.5)
            stop.set()
            mats = instance.fetch_materializations(dg.AssetKey("events"), limit=5000).records
            runs = {}
            for m in mats:
                meta = m.asset_materialization.metadata if m.asset_materialization else {}
                rec = instance.get_run_record_by_id(m.run_id)
                events = {e.dagster_event.event_type_value: e.timestamp for e in instance.all_logs(m.run_id)
                          if e.dagster_event is not None}
                runs[m.run_id] = {
                    "partition": rec.dagster_run.tags.get("dagster/partition") if rec else None,
                    "horizon": int(meta["horizon"].value) if "horizon" in meta else 0,
                    "created": rec.create_timestamp.timestamp() if rec else 0.0,
                    # The queue daemon marks a run STARTING when it dequeues and launches it; the run's
                    # own process reports START once it has loaded the code.
                    "starting": events.get("PIPELINE_STARTING", 0.0),
                    "started": events.get("PIPELINE_START", 0.0),
                    "spark": float(meta["spark_session_seconds"].value) if "spark_session_seconds" in meta else 0.0,
                    "read": float(meta["read_seconds"].value) if "read_seconds" in meta else 0.0,
                    "write": float(meta["write_seconds"].value) if "write_seconds" in meta else 0.0,
                }
    finally:
        drop_database(db)

    from es_pipeline.slices import split

    ranges = split(8)
    pieces: dict[str, list[float]] = {k: [] for k in ("total", "sensor_wait", "queue", "launch", "spark", "read", "write", "other")}
    for sid, tx, committed, slice_ in probes:
        if (sid, 1) not in seen:
            continue
        key = next(r.key for r in ranges if slice_ in r)
        candidates = sorted((r for r in runs.values() if r["partition"] == key and r["horizon"] > tx),
                            key=lambda r: r["horizon"])
        if not candidates:
            continue
        r = candidates[0]
        total = seen[(sid, 1)] - committed
        # The run's milestones, each clipped to the commit (a run created before the commit, whose
        # horizon was read after it, spent no time waiting for this event in the earlier pieces).
        b1 = max(r["created"], committed)
        b2 = max(r["starting"] or b1, b1)
        b3 = max(r["started"] or b2, b2)
        parts = {
            "sensor_wait": b1 - committed, "queue": b2 - b1, "launch": b3 - b2,
            "spark": r["spark"], "read": r["read"], "write": r["write"],
        }
        parts["other"] = max(0.0, total - sum(parts.values()))
        pieces["total"].append(total)
        for k, v in parts.items():
            pieces[k].append(v)
    n = len(pieces["total"])
    rows = [[k, f"{_pct(v, 0.5):.2f}", f"{_pct(v, 0.95):.2f}", f"{statistics.fmean(v):.2f}" if v else "—",
             f"{statistics.fmean(v) / statistics.fmean(pieces['total']):.2f}" if v and k != "total" else "1.00"]
            for k, v in pieces.items()]
    p50 = _pct(pieces["total"], 0.5)
    write_result(
        "commit_to_lake_latency",
        title="commit → Delta latency through sensor, queue, launch, Spark and the batch",
        facts=machine_facts(),
        parameters={"probe_commits": commits, "measured": n, "slice_ranges": 8, "sensor_interval_s": 5,
                    "background_load_events_per_s": 10, "events_writer": "delta-rs (no Spark in events runs)",
                    "dequeue_interval_s": 1},
        columns=["piece", "p50 s", "p95 s", "mean s", "share of mean total"],
        rows=rows,
        figures={k: v for k, v in pieces.items()},
        goals=[Goal("p50 commit-to-lake seconds / 10 s", p50 / 10.0, "<", 1.0)],
        notes=["Pieces per probe event, along the run that extracted it: sensor_wait = run created − commit; "
               "queue = run STARTING (dequeued and launched) − created; launch = run START (its process has loaded "
               "the code) − STARTING; spark = getting a Spark session (0: events runs need none by default); "
               "read/write = the batch; other = the rest (horizon, backlog count, offsets, the poller's 0.25 s)."],
    )


def sensor_tick() -> None:
    small = int(os.environ.get("BENCH_TICK_SMALL", "100000"))
    large = int(os.environ.get("BENCH_TICK_LARGE", "10000000"))
    db = "bench_tick"
    dsn = fresh_database(db)
    figures: dict[str, Any] = {}
    try:
        streams = 10_000
        loaded = 0
        for label, target in (("small", small), ("large", large)):
            bulk_load(dsn, events=target - loaded, streams=streams, events_per_tx=200_000)
            loaded = target
            with psycopg.connect(dsn, autocommit=True) as c:
                c.execute("VACUUM ANALYZE es.events")
                # As after a run: every slice's watermark at the horizon, one new event per range.
                c.execute("DELETE FROM es_pipeline.offsets")
                c.execute("INSERT INTO es_pipeline.offsets (consumer, slice, watermark) SELECT 'events', s, "
                          "pg_snapshot_xmin(pg_current_snapshot()) FROM generate_series(0, 1023) s")
            EventStore(dsn).append(f"tick-{label}", "cart", [NewEvent("ItemAdded", {"sku": "t"})], 0)
            times = []
            with connect(dsn, autocommit=True) as conn:
                for _ in range(20):
                    t0 = time.perf_counter()
                    found = probe(conn, "es", "events")
                    times.append(time.perf_counter() - t0)
            figures[label] = {"events": target, "median_s": statistics.median(times), "min_s": min(times),
                              "ready_slices": len(found.ready_slices)}
    finally:
        drop_database(db)
    ratio = figures["large"]["median_s"] / figures["small"]["median_s"]
    write_result(
        "sensor_tick",
        title="the sensor's probe (one statement, 1024 index probes) vs table size",
        facts=machine_facts(),
        parameters={"small": small, "large": large, "repeats": 20},
        columns=["events in store", "median ms", "min ms", "ratio to small"],
        rows=[[f"{f['events']:,}", f"{f['median_s'] * 1000:.1f}", f"{f['min_s'] * 1000:.1f}",
               f"{f['median_s'] / figures['small']['median_s']:.2f}"] for f in figures.values()],
        figures=figures,
        goals=[Goal("tick large / small", ratio, "<=", 1.5)],
    )


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.latency")
    parser.add_argument("--commits", type=int, default=60)
    parser.add_argument("--only", choices=["latency", "sensor_tick"])
    args = parser.parse_args()
    if args.only in (None, "sensor_tick"):
        sensor_tick()
    if args.only in (None, "latency"):
        latency(args.commits)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
