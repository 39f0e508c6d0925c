"""Commit-to-lake and commit-to-projection latency through the real loop, and the sensor's tick cost.

`python -m bench.latency [--commits 60] [--only latency|projections|sensor_tick|append_cost]`

latency: a Dagster daemon (8 ranges, sensor every 5 s) over Postgres storage, a background demo load,
and one probe commit per second; three phases: one run per range and pass (the baseline), tailing at
20 and at 1,000 events/s. For each probe event: commit time (after COMMIT returns), the pass that
extracted it (the first materialization of its range whose horizon passed its tx_id), its run's Dagster
timestamps, its metadata, and the moment the event became visible in the Delta table (polled every
0.25 s with delta-rs).
projections: the make-dev loop with automation and a tailing run; for each probe event, when each
projection's folded `events` version (its Delta txn version) reached the version that brought it.
sensor_tick: the sensor's one-statement probe, median of 50, with 100 thousand vs 10 million
events in the store (BENCH_TICK_SMALL / BENCH_TICK_LARGE override); beside it the whole tick (new
connection, as the sensor does), the per-slice probe it replaced, and the case of a lagging range.
append_cost: demo appends per second with and without the sensor's transaction-order index, same run.
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

from bench.common import WORK_ROOT, admin_dsn, drop_database, fresh_database, wait_until_extractable
from bench.results import Goal, machine_facts, write_result
from es_pipeline.dev.stack import dagster_stack
from es_pipeline.dev.workload import bulk_load, run_workload
from es_pipeline.extraction.probe import TAIL_ROWS, probe
from es_pipeline.extraction.slices import split
from es_pipeline.extraction.tail import PASS_GAP
from es_pipeline.settings import DEFAULT_FOLLOW_SECONDS as PROJECTIONS_GAP
from es_pipeline.store.conninfo import connect
from es_pipeline.store.event_store import EventStore, NewEvent


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _lake_seen(path: Path, seen: dict[tuple[str, int], float], stop: threading.Event,
               versions: dict[tuple[str, int], int] | None = None) -> None:
    from deltalake import DeltaTable
    from deltalake.exceptions import DeltaError, TableNotFoundError

    last = -1
    while not stop.is_set():
        if (path / "_delta_log").is_dir():
            try:
                dt = DeltaTable(str(path))
                if dt.version() != last:
                    now = time.time()
                    t = dt.to_pyarrow_table(columns=["stream_id", "version"])
                    for k in zip(t.column("stream_id").to_pylist(), t.column("version").to_pylist(), strict=True):
                        seen.setdefault(k, now)
                        if versions is not None:
                            versions.setdefault(k, dt.version())
                    last = dt.version()  # only once read: a failed read is tried again
            except (OSError, DeltaError, TableNotFoundError):
                pass  # the log is being created or a commit is half-written: look again
        time.sleep(0.25)


SENSOR_INTERVAL = "default (5 one pass per run, 30 tailing)"  # the stacks run make dev's sensor interval
PIECES = ("total", "sensor_wait", "queue", "launch", "pass_wait", "spark", "read", "write", "other")


def _phase(commits: int, *, tail: int, rate: float) -> dict[str, Any]:
    """One stack, a background load at `rate` events/s, `commits` probe commits a second apart: each probe
    event's commit → lake seconds, cut into pieces along the run (and, tailing, the pass) that took it."""
    db = "bench_latency"
    dsn = fresh_database(db)
    store = EventStore(dsn)
    try:
        with tempfile.TemporaryDirectory(dir=WORK_ROOT if WORK_ROOT.exists() else None) as tmp, \
                dagster_stack(admin_dsn=admin_dsn(), dsn=dsn, tmp=Path(tmp), slice_ranges=8, sensor_interval=None,
                              extra_env={"ES_PIPELINE_TAIL_SECONDS": str(tail), "ES_PIPELINE_REPORT_SECONDS": "0"}) as stack:
            os.environ["DAGSTER_HOME"], os.environ["DAGSTER_PG_URL"] = stack.env["DAGSTER_HOME"], stack.env["DAGSTER_PG_URL"]
            instance = dg.DagsterInstance.get()
            seen: dict[tuple[str, int], float] = {}
            stop = threading.Event()
            poller = threading.Thread(target=_lake_seen, args=(stack.warehouse / "events", seen, stop), daemon=True)
            poller.start()
            fast = rate > 100
            background = threading.Thread(target=run_workload, args=(store,), kwargs=dict(
                streams=2000 if fast else 200, events=None, writers=8 if fast else 2, rollback_rate=0.1,
                max_commit_delay=0.02 if fast else 0.1, rate=rate, stop=stop, max_events_per_tx=20 if fast else 4),
                daemon=True)
            load_started = time.monotonic()
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
            background.join()
            load_seconds = time.monotonic() - load_started
            written = store_count(dsn)
            passes = _passes(instance)
            instance.dispose()
    finally:
        drop_database(db)
    return {"tail": tail, "rate": rate, "written": written, "achieved_rate": written / load_seconds,
            **_pieces(probes, seen, passes)}


def store_count(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM es.events").fetchone()
    return int(row[0]) if row else 0


def _passes(instance: Any) -> list[dict[str, Any]]:
    """Every materialization of `events` (a one-pass run's, or a tailing run's pass per partition), with
    its run's Dagster timestamps."""
    out, runs = [], {}
    records, cursor = [], None
    while True:  # Dagster hands out at most 10,000 records a call
        page = instance.fetch_materializations(dg.AssetKey("events"), limit=5000, cursor=cursor)
        records += page.records
        if not page.has_more:
            break
        cursor = page.cursor
    for m in records:
        meta = m.asset_materialization.metadata if m.asset_materialization else {}
        if "horizon" not in meta or "total_seconds" not in meta:
            continue  # a tailing run's closing summary, not a pass
        if m.run_id not in runs:
            rec = instance.get_run_record_by_id(m.run_id)
            events = {e.dagster_event.event_type_value: e.timestamp for e in instance.all_logs(m.run_id)
                      if e.dagster_event is not None and e.dagster_event.event_type_value in ("PIPELINE_STARTING",
                                                                                             "PIPELINE_START")}
            runs[m.run_id] = {
                "created": rec.create_timestamp.timestamp() if rec else 0.0,
                # The queue daemon marks a run STARTING when it dequeues and launches it; the run's own
                # process reports START once it has loaded the code.
                "starting": events.get("PIPELINE_STARTING", 0.0), "started": events.get("PIPELINE_START", 0.0),
            }
        out.append({
            **runs[m.run_id], "partition": m.partition_key, "horizon": int(meta["horizon"].value),
            "logged": m.timestamp, "total": float(meta["total_seconds"].value),
            "spark": float(meta["spark_session_seconds"].value) if "spark_session_seconds" in meta else 0.0,
            "read": float(meta["read_seconds"].value), "write": float(meta["write_seconds"].value),
        })
    return out


def _pieces(probes: list[tuple[str, int, float, int]], seen: dict[tuple[str, int], float],
            passes: list[dict[str, Any]]) -> dict[str, Any]:
    ranges = split(8)
    pieces: dict[str, list[float]] = {k: [] for k in PIECES}
    not_seen: list[str] = []  # never visible in the lake within the wait: reported, never dropped silently
    unattributed: list[str] = []  # visible, but no materialization of its range has a horizon above its tx
    for sid, tx, committed, slice_ in probes:
        if (sid, 1) not in seen:
            not_seen.append(sid)
            continue
        key = next(r.key for r in ranges if slice_ in r)
        candidates = sorted((p for p in passes if p["partition"] == key and p["horizon"] > tx),
                            key=lambda p: p["horizon"])
        if not candidates:
            unattributed.append(sid)
            continue
        r = candidates[0]
        total = seen[(sid, 1)] - committed
        # The run's milestones, each clipped to the commit (a run created before the commit, whose
        # horizon was read after it, spent no time waiting for this event in the earlier pieces); for a
        # tailing run, the wait from there to the start of the pass that took the event.
        b1 = max(r["created"], committed)
        b2 = max(r["starting"] or b1, b1)
        b3 = max(r["started"] or b2, b2)
        b4 = max(r["logged"] - r["total"], b3)
        parts = {
            "sensor_wait": b1 - committed, "queue": b2 - b1, "launch": b3 - b2, "pass_wait": b4 - b3,
            "spark": r["spark"], "read": r["read"], "write": r["write"],
        }
        parts["other"] = max(0.0, total - sum(parts.values()))
        pieces["total"].append(total)
        for k, v in parts.items():
            pieces[k].append(v)
    return {"pieces": pieces, "not_seen": not_seen, "unattributed": unattributed}


def latency(commits: int) -> None:
    """Commit → lake: one pass per run (the baseline), then tailing runs at make dev's rate and at 2,000/s."""
    tail = 300
    phases = [("one pass per run, 10 events/s", _phase(commits, tail=0, rate=10.0)),
              ("tailing, 20 events/s", _phase(commits, tail=tail, rate=20.0)),
              ("tailing, 2,000 events/s", _phase(commits, tail=tail, rate=2000.0))]
    base = _pct(phases[0][1]["pieces"]["total"], 0.5)
    rows, figures, goals = [], {}, []
    for label, ph in phases:
        pieces = ph["pieces"]
        total = pieces["total"]
        p50, p95 = _pct(total, 0.5), _pct(total, 0.95)
        rows.append([label + (" ← baseline" if label == phases[0][0] else ""), f"{ph['achieved_rate']:,.0f}",
                     f"{len(total)}",
                     f"{p50:.2f}", f"{p95:.2f}", f"{p50 / base:.2f}",
                     *[f"{statistics.fmean(pieces[k]):.2f}" if pieces[k] else "—" for k in PIECES[1:]],
                     f"{len(ph['not_seen'])}"])
        figures[label] = {"tail_seconds": ph["tail"], "rate": ph["rate"], "events_written": ph["written"],
                          "achieved_rate": round(ph["achieved_rate"], 1),
                          "not_seen": ph["not_seen"], "unattributed": ph["unattributed"], "pieces": pieces}
        if ph["tail"]:  # issue 47: p50 < 1 s, p95 < 2 s at make dev's rate; within twice those at 2,000 events/s
            scale = 1.0 if ph["rate"] <= 100 else 2.0
            goals += [Goal(f"p50 commit-to-lake s, {label}", p50, "<", 1.0 * scale),
                      Goal(f"p95 commit-to-lake s, {label}", p95, "<", 2.0 * scale)]
    write_result(
        "commit_to_lake_latency",
        title="commit → Delta latency: one run per pass vs tailing runs, with the pieces",
        facts=machine_facts(),
        parameters={"probe_commits_per_phase": commits, "slice_ranges": 8, "sensor_interval_s": SENSOR_INTERVAL,
                    "tail_seconds": tail, "events_writer": "delta-rs (no Spark in events runs)"},
        columns=["phase", "events/s achieved", "probes seen", "p50 s", "p95 s", "p50 ratio", *[f"{k} (mean s)" for k in PIECES[1:]],
                 "not seen"],
        rows=rows,
        figures=figures,
        goals=goals,
        notes=["Pieces per probe event, along the pass that extracted it (the first materialization of its range "
               "whose horizon passed its tx id): sensor_wait = its run created − commit; queue = run STARTING "
               "(dequeued and launched) − created; launch = run START (its process has loaded the code) − "
               "STARTING; pass_wait = the pass's start − START (a tailing run waiting for the NOTIFY, the 1 s "
               f"that gathers commits or the rest of the {PASS_GAP:g} s since the last pass began, the probe); "
               "spark = getting a Spark session (0: none by default); "
               "read/write = the pass; other = the rest (horizon, offsets, Dagster logging, the lake poller's "
               "0.25 s). Each piece is clipped at the commit, so a run that started before it counts from it. "
               "The runs report every pass here (ES_PIPELINE_REPORT_SECONDS=0; 30 s by default), so that each "
               "probe event can be attributed to its pass.",
               "Background load: demo writers (10 % rollbacks; two writers, commits held up to 0.1 s; at 1,000 "
               "events/s eight writers, up to 20 events a transaction, commits held up to 0.02 s). Probe events not visible in the lake within 180 s "
               "of the last commit are counted in 'not seen', never left out silently."],
    )


# The tables measured, with the column each probe event's key shows in (its stream, or its `sku` for the
# cross-stream projection): built-in, a typed state table, a cross-stream projection and a typed event table, all
# of the shop's domain (examples/shop), which the stack folds with.
PROJECTION_TABLES = {"events": "stream_id", "stream_state": "stream_id", "stream_catalog": "stream_id",
                     "stream_state_cart": "stream_id", "sku_sales": "sku", "events_item_added": "stream_id"}


def _first_seen(path: Path, column: str, wanted: set[str], seen: dict[str, float], stop: threading.Event) -> None:
    """Every 0.25 s, the files the table gained since the last look (its add actions), read for `column` alone:
    when each wanted key first shows. Only new files are read, so the look stays cheap as the table grows."""
    import pyarrow.parquet as pq
    from deltalake import DeltaTable
    from deltalake.exceptions import DeltaError, TableNotFoundError

    read: set[str] = set()
    last = -1
    while not stop.is_set():
        try:
            if (path / "_delta_log").is_dir():
                dt = DeltaTable(str(path))
                if dt.version() != last:
                    now = time.time()
                    files = dt.get_add_actions(flatten=True).column("path").to_pylist()
                    for f in files:
                        if f in read:
                            continue
                        keys = pq.read_table(str(path / f), columns=[column]).column(column).to_pylist()
                        for k in wanted.intersection(str(x) for x in keys):
                            seen.setdefault(k, now)
                        read.add(f)
                    last = dt.version()
        except (OSError, DeltaError, TableNotFoundError, KeyError):
            pass  # being created, a file compacted away, a commit half-written: look again
        time.sleep(0.25)


def _projections_phase(commits: int, rate: float) -> dict[str, Any]:
    """The make-dev loop (automation, tailing runs, the shop's domain) under `rate` events/s, `commits` probe
    events a second apart (each a new cart with a new sku): for each table, when each probe first shows in it."""
    from bench.steady_state import warm_up

    db = "bench_latency_projections"
    dsn = fresh_database(db)
    store = EventStore(dsn)
    tail = 300
    fast = rate > 100
    ids = {f"probe-{i}" for i in range(commits)}
    try:
        with tempfile.TemporaryDirectory(dir=WORK_ROOT if WORK_ROOT.exists() else None) as tmp, \
                dagster_stack(admin_dsn=admin_dsn(), dsn=dsn, tmp=Path(tmp), slice_ranges=8, sensor_interval=None,
                              automation=True, extra_env={"ES_PIPELINE_TAIL_SECONDS": str(tail),
                                                          "ES_PIPELINE_DOMAIN": "shop.domain"}) as stack:
            os.environ["DAGSTER_HOME"], os.environ["DAGSTER_PG_URL"] = stack.env["DAGSTER_HOME"], stack.env["DAGSTER_PG_URL"]
            instance = dg.DagsterInstance.get()
            seen: dict[str, dict[str, float]] = {name: {} for name in PROJECTION_TABLES}
            stop = threading.Event()
            background = threading.Thread(target=run_workload, args=(store,), kwargs=dict(
                streams=2000 if fast else 200, events=None, writers=8 if fast else 2, rollback_rate=0.1,
                max_commit_delay=0.02 if fast else 0.1, rate=rate, stop=stop, max_events_per_tx=20 if fast else 4),
                daemon=True)
            background.start()
            warmup = warm_up(instance, stack.warehouse, limit=400.0)
            pollers = [threading.Thread(target=_first_seen, daemon=True, args=(
                stack.warehouse / name, column, ids, seen[name], stop)) for name, column in PROJECTION_TABLES.items()]
            for p in pollers:
                p.start()
            b0, t0 = _jiffies()
            started = time.monotonic()
            probes: list[tuple[str, float]] = []
            for i in range(commits):
                sid = f"probe-{i}"
                store.append(sid, "cart", [NewEvent("ItemAdded", {"sku": sid, "qty": 1, "unit_price": 1.0})], 0)
                probes.append((sid, time.time()))
                time.sleep(1.0)
            b1, t1 = _jiffies()
            busy = (b1 - b0) / max(t1 - t0, 1) * (os.cpu_count() or 1)
            window = time.monotonic() - started
            deadline = time.monotonic() + 90
            while any(len(seen[n]) < commits for n in PROJECTION_TABLES) and time.monotonic() < deadline:
                time.sleep(1.0)
            stop.set()
            background.join()
            instance.dispose()
    finally:
        drop_database(db)
    out: dict[str, Any] = {"rate": rate, "warmup_s": warmup, "busy_cores": busy, "window_s": window, "tables": {}}
    for name in PROJECTION_TABLES:
        waits = [seen[name][sid] - committed for sid, committed in probes if sid in seen[name]]
        out["tables"][name] = {"waits": waits, "missing": [sid for sid, _ in probes if sid not in seen[name]]}
    return out


def _jiffies() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def projections_latency(commits: int) -> None:
    """Commit → table under make dev's loop with tailing runs, at make dev's 20 events/s and at 2,000 events/s:
    `events`, `stream_state`, `stream_catalog`, a typed state table, a cross-stream projection, a typed event
    table. Goals at 20 events/s (issue 47): `events` p50 < 1 s, p95 < 2 s; the projections p50 < 2 s, p95 < 4 s;
    at 2,000 events/s within twice those."""
    phases = [_projections_phase(commits, 20.0), _projections_phase(commits, 2000.0)]
    rows, figures, goals = [], {}, []
    for ph in phases:
        label = f"{ph['rate']:,.0f} events/s"
        scale = 1.0 if ph["rate"] <= 100 else 2.0
        figures[label] = {"warmup_s": round(ph["warmup_s"], 1), "busy_cores": round(ph["busy_cores"], 3),
                          "tables": ph["tables"]}
        for name, t in ph["tables"].items():
            p50, p95 = _pct(t["waits"], 0.5), _pct(t["waits"], 0.95)
            rows.append([label, name, f"{len(t['waits'])}", f"{p50:.2f}", f"{p95:.2f}", f"{len(t['missing'])}",
                         f"{ph['busy_cores']:.2f}"])
            goal50, goal95 = (1.0, 2.0) if name == "events" else (2.0, 4.0)
            goals += [Goal(f"p50 commit-to-{name} s, {label}", p50, "<", goal50 * scale),
                      Goal(f"p95 commit-to-{name} s, {label}", p95, "<", goal95 * scale)]
        goals.append(Goal(f"probes never seen, {label}", sum(len(t["missing"]) for t in ph["tables"].values()),
                          "<=", 0))
    write_result(
        "commit_to_projection_latency",
        title="commit → table latency under the make-dev loop with tailing runs, at 20 and 2,000 events/s",
        facts=machine_facts(),
        parameters={"probe_commits": commits, "slice_ranges": 8, "sensor_interval_s": SENSOR_INTERVAL,
                    "tail_seconds": 300, "follow_gap_s": PROJECTIONS_GAP, "pass_gap_s": PASS_GAP,
                    "domain": "shop.domain", "automation": "on"},
        columns=["load", "table", "probes seen", "p50 s", "p95 s", "not seen", "busy cores (whole machine)"],
        rows=rows, figures=figures, goals=goals,
        notes=["For each probe event (a new cart stream with one ItemAdded of a new sku, a second apart, beside the "
               "demo writers' load): its commit time (after COMMIT returns), and the first moment each table holds "
               "its key: a poller per table reads the files each new Delta version added (its add actions), every "
               "0.25 s, so a wait includes up to 0.25 s of polling. Measured after the projections' first builds, "
               "while the tailing run keeps them. A probe not seen within 90 s of the last commit is counted in "
               "'not seen', never left out. Busy cores: the whole machine over the probes' minute (writers, "
               "pollers and all)."],
    )


# The probe before the tail (one index probe per slice, 1024 per tick): the baseline, measured in the same run.
PER_SLICE_PROBE = """
WITH h AS MATERIALIZED (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS h),
w AS (SELECT g.slice::smallint AS slice, coalesce(o.watermark, '0'::xid8) AS wm
      FROM generate_series(0, 1023) AS g(slice)
      LEFT JOIN es_pipeline.offsets o ON o.consumer = 'events' AND o.slice = g.slice)
SELECT (SELECT h::text::bigint FROM h),
       (SELECT array_agg(w.slice) FROM w, h WHERE EXISTS (
           SELECT 1 FROM es.events e WHERE e.slice = w.slice AND e.tx_id >= w.wm AND e.tx_id < h.h))
"""
TICK_REPEATS = 50


def _median_ms(fn: Any, repeats: int = TICK_REPEATS) -> tuple[float, float, Any]:
    fn()  # warm: the first call plans the statement and reads the pages
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000, min(times) * 1000, result


def _tick_figures(dsn: str, label: str) -> dict[str, Any]:
    """Each way of asking, on one state of the store: what it costs and what it found."""
    ranges = split(8)
    wait_until_extractable(dsn)  # the watermarks below go past every event so far, whatever is open elsewhere
    with psycopg.connect(dsn, autocommit=True) as c:
        # As after a run of every range: every slice's watermark at the horizon; then one new event per range.
        c.execute("DELETE FROM es_pipeline.offsets")
        c.execute("INSERT INTO es_pipeline.offsets (consumer, slice, watermark) SELECT 'events', s, "
                  "pg_snapshot_xmin(pg_current_snapshot()) FROM generate_series(0, 1023) s")
    store = EventStore(dsn)
    wanted: set[str] = set()
    n = 0
    while len(wanted) < len(ranges):
        sid = f"tick-{label}-{n}"
        n += 1
        r = next(r.key for r in ranges if store.slice_of(sid) in r.slices)
        if r not in wanted:
            wanted.add(r)
            store.append(sid, "cart", [NewEvent("ItemAdded", {"sku": "t"})], 0)
    out: dict[str, Any] = {}
    with connect(dsn, autocommit=True) as conn:
        out["tail"] = _median_ms(lambda: probe(conn, "es", "events").ready_slices)
        out["per_slice"] = _median_ms(lambda: frozenset(conn.execute(PER_SLICE_PROBE).fetchone()[1] or ()))  # type: ignore[index]

    def whole_tick() -> frozenset[int]:  # what the sensor does: a new connection, the statement planned anew
        with connect(dsn, autocommit=True, application_name="es_pipeline sensor") as c:
            return probe(c, "es", "events").ready_slices

    out["whole_tick"] = _median_ms(whole_tick, repeats=20)
    with psycopg.connect(dsn, autocommit=True) as c:  # one range never extracted: its 128 slices probed one by one
        c.execute("UPDATE es_pipeline.offsets SET watermark = '1' WHERE slice = ANY(%s)", (list(ranges[0].slices),))
    with connect(dsn, autocommit=True) as conn:
        out["lagging_range"] = _median_ms(lambda: probe(conn, "es", "events").ready_slices)
    answers = {k: v[2] for k, v in out.items() if k != "lagging_range"}
    if len(set(answers.values())) != 1:
        raise SystemExit(f"sensor_tick: the probes disagree: {answers}")
    return {k: {"median_ms": v[0], "min_ms": v[1], "ready_slices": len(v[2])} for k, v in out.items()}


def sensor_tick() -> None:
    small = int(os.environ.get("BENCH_TICK_SMALL", "100000"))
    large = int(os.environ.get("BENCH_TICK_LARGE", "10000000"))
    db = "bench_tick"
    dsn = fresh_database(db)
    figures: dict[str, Any] = {}
    try:
        loaded = 0
        for label, target in (("small", small), ("large", large)):
            bulk_load(dsn, events=target - loaded, streams=10_000, events_per_tx=200_000)
            loaded = target
            with psycopg.connect(dsn, autocommit=True) as c:
                # Measure a settled store, as the sensor meets it: not while the checkpointer is still
                # writing out the bulk load (which slowed every query here by up to 4x).
                c.execute("VACUUM ANALYZE es.events")
                c.execute("CHECKPOINT")
            figures[label] = {"events": target, **_tick_figures(dsn, label)}
    finally:
        drop_database(db)
    small_f, large_f = figures["small"], figures["large"]
    labels = {
        "tail": "probe: tail of the transaction-order index (es_pipeline)",
        "whole_tick": "whole tick: connect + plan + probe (as the sensor)",
        "per_slice": "baseline: 1024 per-slice index probes (before)",
        "lagging_range": "probe, one range never extracted (128 slices probed)",
    }
    rows = [
        [text, f"{small_f[k]['median_ms']:.2f}", f"{large_f[k]['median_ms']:.2f}",
         f"{large_f[k]['median_ms'] / small_f[k]['median_ms']:.2f}",
         f"{large_f[k]['median_ms'] / large_f['per_slice']['median_ms']:.2f}"]
        for k, text in labels.items()
    ]
    write_result(
        "sensor_tick",
        title="the sensor's probe vs table size (steady state: every range extracted, one new event per range)",
        facts=machine_facts(),
        parameters={"small": small, "large": large, "repeats": TICK_REPEATS, "tail_rows": TAIL_ROWS},
        columns=["what", f"{small:,} events: median ms", f"{large:,} events: median ms", "large / small",
                 "large: ratio to per-slice baseline"],
        rows=rows,
        figures=figures,
        goals=[
            Goal("tick large / small", large_f["tail"]["median_ms"] / small_f["tail"]["median_ms"], "<=", 1.5),
            Goal("whole tick large / small", large_f["whole_tick"]["median_ms"] / small_f["whole_tick"]["median_ms"],
                 "<=", 1.5),
        ],
    )


def append_cost() -> None:
    """What the sensor's transaction-order index costs the writers: demo appends with and without it, same run."""
    events, rounds = int(os.environ.get("BENCH_APPEND_EVENTS", "20000")), 2
    db = "bench_append"
    figures: dict[str, list[float]] = {"with events_tx_order_idx": [], "without": []}
    try:
        for _ in range(rounds):  # alternate, so drift on the machine falls on both
            for label in figures:
                dsn = fresh_database(db)
                if label == "without":
                    with psycopg.connect(dsn, autocommit=True) as c:
                        c.execute("DROP INDEX es.events_tx_order_idx")
                report = run_workload(EventStore(dsn), streams=1000, events=events, writers=4,
                                      rollback_rate=0.0, max_commit_delay=0.0)
                figures[label].append(report.events_per_second)
    finally:
        drop_database(db)
    base = statistics.median(figures["without"])
    write_result(
        "append_cost",
        title="appends per second with and without the sensor's transaction-order index (4 writers, 1-4 events per transaction)",
        facts=machine_facts(),
        parameters={"events": events, "rounds": rounds, "writers": 4},
        columns=["events table", "events/s (median)", "ratio to without"],
        rows=[[k, f"{statistics.median(v):,.0f}", f"{statistics.median(v) / base:.2f}"] for k, v in figures.items()],
        figures=figures,
        goals=[],
    )


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.latency")
    parser.add_argument("--commits", type=int, default=60)
    parser.add_argument("--only", choices=["latency", "projections", "sensor_tick", "append_cost"])
    args = parser.parse_args()
    if args.only in (None, "sensor_tick"):
        sensor_tick()
    if args.only in (None, "append_cost"):
        append_cost()
    if args.only in (None, "latency"):
        latency(args.commits)
    if args.only in (None, "projections"):
        projections_latency(args.commits)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
