"""rebuild_beside: another type's freshness while one stream type is rebuilt beside `stream_state` (issue 46).

The bulk load's accounts (`BENCH_EVENTS` events, 50 per stream: 5M by default) extracted and folded; then a
tailing loop as a tailing run keeps the lake (extract every slice, then `follow`: every projection's small
increment, lake/follow.py), with a probe writer committing one new cart every second. Each probe's latency is
from its commit returning to the first loop after which `stream_state` holds it. Two phases, one run:

- baseline: the loop and the probes alone, `PROBES` probes;
- rebuild: the account reducer's revision bumped; the tailing loop folds under the new revision (the accounts
  held back, lake/state/rebuild.py), while another process (as the `stream_state` asset's run would be) builds
  the accounts beside it and swaps them in (`rebuild.run_pending`, in process: the engine rule keeps 5M events
  here); probes until that process ends. `REBUILDS` times in a row (revision + 1, + 2, + 3), the probes of all
  counted together.

The goal: p50 and p95 of the rebuild phase over the baseline's, each ≤ 1.5.
"""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from bench.common import (
    ALL_SLICES,
    EVENTS_PER_STREAM,
    SCHEMA,
    Sizes,
    load_events,
    log,
    wait_until_extractable,
)
from bench.results import Goal, n, ratio, secs
from es_pipeline.domain import Domain
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.lake.follow import follow
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state import forked, rebuild
from es_pipeline.lake.state.stream_state import update_stream_state

NAME = "rebuild_beside"
GOAL = 1.5
PROBE_EVERY = 1.0  # seconds between two probes
LOOP_PAUSE = 0.5  # seconds the tailing loop waits after each pass
PROBES = 40  # the baseline's probes (the rebuild phase takes as many as it lasts, 5 at least); a tenth below
SMALL = 1_000_000  # events (bench-smoke's few thousand: the path run, not measured)


def _domain(bump: int) -> Domain:
    """The shop's domain without its cross-stream projection (the loop's increments: the built-in tables and
    `stream_state`), the account reducer's revision raised by `bump`."""
    out = copy.copy(SHOP)
    out.reducers = {t: dataclasses.replace(r, revision=r.revision + (bump if t == "account" else 0))
                    for t, r in SHOP.reducers.items()}
    out.projections = {}
    out._folds = None
    return out


BASE = _domain(0)
REBUILDS = 3  # the accounts rebuilt this many times in a row (revision + 1, + 2, + 3): more probes to count


def _burn(seconds: float) -> None:
    """A control: one core's worth of pure Python arithmetic, no I/O, for `seconds`, as the rebuild's forked
    folds run (in a scheduling group of its own at the lowest priority: lake/state/forked.py `in_background`)."""
    forked.in_background()
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x = (x * 31 + 7) % 1_000_003


def _rebuild_process(dsn: str, lake: str, bump: int) -> None:
    """The other process: every pending rebuild, as the `stream_state` asset's run does after its increment."""
    import logging
    import sys

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s rebuild %(message)s",
                        datefmt="%H:%M:%S")
    started = time.perf_counter()
    swapped = rebuild.run_pending(Engine("local"), lake, _domain(bump), dsn)
    log.info("[%s] rebuild process: %s swapped in %.1f s", NAME, swapped, time.perf_counter() - started)
    if swapped != ["account"]:
        raise SystemExit(f"the rebuild swapped {swapped}, not the accounts")


class Loop:
    """The tailing loop and the probe writer of one phase."""

    def __init__(self, dsn: str, lake: Path, domain: Domain, phase: str) -> None:
        self.dsn, self.lake, self.domain, self.phase = dsn, lake, domain, phase
        self.committed: dict[str, float] = {}
        self.seen: dict[str, float] = {}
        self.passes = 0
        self.held_passes = 0
        self.extract_s: list[float] = []  # per pass: the extraction's seconds,
        self.follow_s: list[float] = []  # the increments' (lake/follow.py)  # passes whose stream_state increment held the accounts back
        self.stop_probes = threading.Event()
        self.stop_loop = threading.Event()
        self.failed: list[BaseException] = []

    def probes(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                i = 0
                while not self.stop_probes.is_set():
                    stream_id = f"probe-{self.phase}-{i:05d}"
                    conn.execute(f"INSERT INTO {SCHEMA}.events (stream_id, stream_type, version, event_type, payload) "
                                 "VALUES (%s, 'cart', 1, 'ItemAdded', '{\"sku\": \"P\", \"qty\": 1, "
                                 "\"unit_price\": 1.0}')", (stream_id,))
                    self.committed[stream_id] = time.time()
                    i += 1
                    self.stop_probes.wait(PROBE_EVERY)
        except BaseException as exc:  # noqa: BLE001 - reported by the bench
            self.failed.append(exc)

    def tail(self) -> None:
        try:
            extractor = Extractor(self.dsn, None, self.lake, schema=SCHEMA)
            state = str(self.lake / "stream_state")
            while not self.stop_loop.is_set():
                t0 = time.perf_counter()
                extractor.run(ALL_SLICES, run_id=f"bench-rebuild-{self.phase}-{self.passes}")
                t1 = time.perf_counter()
                done = follow(self.lake, self.dsn, self.domain).get("stream_state")
                self.extract_s.append(t1 - t0)
                self.follow_s.append(time.perf_counter() - t1)
                self.held_passes += bool(done is not None and done.listed("rebuilding_types"))
                now = time.time()
                rows = DeltaTable(state).to_pyarrow_table(columns=["stream_id"], filters=[("stream_type", "=", "cart")])
                for stream_id in rows["stream_id"].to_pylist():
                    self.seen.setdefault(stream_id, now)
                self.passes += 1
                if self.stop_probes.is_set() and set(self.committed) <= set(self.seen):
                    return
                time.sleep(LOOP_PAUSE)
        except BaseException as exc:  # noqa: BLE001 - reported by the bench
            self.failed.append(exc)

    def run(self, until: Any) -> list[float]:
        """The phase until `until()` is true (checked every probe), then until every probe is seen; latencies."""
        threads = [threading.Thread(target=self.probes), threading.Thread(target=self.tail)]
        for t in threads:
            t.start()
        try:
            while not until() and not self.failed:
                time.sleep(PROBE_EVERY / 4)
        finally:
            self.stop_probes.set()
            threads[0].join()
            threads[1].join(timeout=600)
            self.stop_loop.set()
        if self.failed:
            raise self.failed[0]
        return [self.seen[s] - at for s, at in self.committed.items()]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(dsn: str, work: Path, sizes: Sizes) -> dict[str, Any]:
    streams = max(1, sizes.events // EVENTS_PER_STREAM)
    log.info("[%s] %s account events over %s streams", NAME, f"{streams * EVENTS_PER_STREAM:,}", f"{streams:,}")
    load_events(dsn, streams * EVENTS_PER_STREAM, streams)
    wait_until_extractable(dsn)
    lake = work / "lake"
    events = Extractor(dsn, None, lake, schema=SCHEMA, progress=log.info).run(ALL_SLICES, run_id="bench-load").rows
    t0 = time.perf_counter()
    update_stream_state(Engine(), lake, domain=BASE, store_dsn=dsn)
    first_build = time.perf_counter() - t0
    log.info("[%s] first build: %.1f s", NAME, first_build)

    baseline = Loop(dsn, lake, BASE, "baseline")
    probes = PROBES if events >= SMALL else PROBES // 10
    base = baseline.run(lambda: len(baseline.committed) >= probes)
    log.info("[%s] baseline: %d probes, p50 %.2f s, p95 %.2f s", NAME, len(base), _pct(base, 0.5), _pct(base, 0.95))

    # The controls: the same loop beside processes that only compute, at the rebuild's niceness: on every core, and
    # on every core but one (what a rebuild takes, lake/state/rebuild.py).
    controls: list[tuple[int, list[float], Loop]] = []
    for count in (os.cpu_count() or 1, max(1, (os.cpu_count() or 1) - 1)):
        burners = [multiprocessing.get_context("spawn").Process(target=_burn, args=(3600.0,)) for _ in range(count)]
        for b in burners:
            b.start()
        control = Loop(dsn, lake, BASE, f"control{count}")
        try:
            burned = control.run(lambda control=control: len(control.committed) >= probes // 2)
        finally:
            for b in burners:
                b.kill()
                b.join()
        controls.append((count, burned, control))
        log.info("[%s] beside %d niced CPU burners: p50 %.2f s, p95 %.2f s", NAME, count, _pct(burned, 0.5),
                 _pct(burned, 0.95))

    rebuilding: list[float] = []
    seconds: list[float] = []
    loops: list[Loop] = []
    for bump in range(1, REBUILDS + 1):
        during = Loop(dsn, lake, _domain(bump), f"rebuild{bump}")
        child = multiprocessing.get_context("spawn").Process(target=_rebuild_process, args=(dsn, str(lake), bump))
        started = time.perf_counter()
        child.start()
        ended: list[float] = []

        def rebuilt(child: Any = child, ended: list[float] = ended, started: float = started,
                    during: Loop = during) -> bool:
            if not ended and not child.is_alive():
                ended.append(time.perf_counter() - started)
            return bool(ended) and len(during.committed) >= 5

        rebuilding += during.run(rebuilt)
        loops.append(during)
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"the rebuild process failed (exit code {child.exitcode})")
        seconds.append(ended[0])
        accounts = DeltaTable(str(lake / "stream_state")).to_pyarrow_table(
            columns=["revision"], filters=[("stream_type", "=", "account")])["revision"].to_pylist()
        if len(accounts) != streams or set(accounts) != {_domain(bump).folds["account"].revision}:
            raise RuntimeError(f"after rebuild {bump}: {len(accounts)} accounts of revisions {set(accounts)}")
    rebuild_seconds = statistics.median(seconds)
    log.info("[%s] rebuild: %.1f s, %d probes, p50 %.2f s, p95 %.2f s", NAME, rebuild_seconds, len(rebuilding),
             _pct(rebuilding, 0.5), _pct(rebuilding, 0.95))

    p50, p95 = _pct(rebuilding, 0.5) / _pct(base, 0.5), _pct(rebuilding, 0.95) / _pct(base, 0.95)

    def row(label: str, lat: list[float], passes: int, baseline_row: bool = False) -> list[str]:
        return [label + (" ← baseline" if baseline_row else ""), str(len(lat)), secs(_pct(lat, 0.5)),
                secs(_pct(lat, 0.95)), secs(max(lat)), ratio(_pct(lat, 0.5) / _pct(base, 0.5)),
                ratio(_pct(lat, 0.95) / _pct(base, 0.95)), str(passes)]

    return {
        "title": f"another type's commit → stream_state latency while {n(events)} events of one type are rebuilt "
                 "beside it",
        "parameters": {"events": events, "streams": streams, "probe_every_s": PROBE_EVERY,
                       "loop_pause_s": LOOP_PAUSE, "baseline_probes": probes},
        "columns": ["phase", "probes", "p50 s", "p95 s", "max s", "p50 ratio", "p95 ratio", "loop passes"],
        "rows": [row("tailing loop alone", base, baseline.passes, True),
                 *[row(f"control: beside {count} CPU-bound processes in the background (no I/O)", burned, control.passes)
                   for count, burned, control in controls],
                 row(f"tailing loop while the accounts are rebuilt ({REBUILDS} rebuilds, median "
                     f"{secs(rebuild_seconds)} s each)", rebuilding, sum(x.passes for x in loops))],
        "figures": {"first_build_seconds": round(first_build, 3), "rebuild_seconds": [round(x, 3) for x in seconds],
                    "baseline_latencies_s": [round(x, 3) for x in base],
                    "rebuild_latencies_s": [round(x, 3) for x in rebuilding],
                    "passes_holding_accounts": sum(x.held_passes for x in loops),
                    "pass_seconds_median": {
                        "baseline": {"extract": round(statistics.median(baseline.extract_s), 3),
                                     "follow": round(statistics.median(baseline.follow_s), 3)},
                        **{f"control_{count}": {"extract": round(statistics.median(c.extract_s), 3),
                                                "follow": round(statistics.median(c.follow_s), 3)}
                           for count, _, c in controls},
                        "rebuild": {"extract": round(statistics.median([x for lp in loops for x in lp.extract_s]), 3),
                                    "follow": round(statistics.median([x for lp in loops for x in lp.follow_s]), 3)}},
                    "p50_ratio": round(p50, 4), "p95_ratio": round(p95, 4)},
        "goals": [Goal("p50 commit → stream_state, rebuilding / not", p50, "<=", GOAL),
                  Goal("p95 commit → stream_state, rebuilding / not", p95, "<=", GOAL)],
        "notes": [
            "One probe (a new cart, one event) commits every second; the tailing loop extracts every slice and "
            "takes every projection's small increment (lake/follow.py) back to back, pausing "
            f"{LOOP_PAUSE} s. A probe's latency ends at the first pass after which `stream_state` holds it.",
            "The rebuild runs in another process, as the `stream_state` asset's run would: its build (the spread, "
            "the pieces' forked folds, the catch-up) at niceness +10 (lake/state/rebuild.py `NICE`), the swap at the "
            "process's own; the swap takes `stream_state`'s turn, and the loop's increment skips a pass meanwhile. The rebuild phase's last probes may be taken after the rebuild has ended "
            "(5 at least).",
            "The controls separate the rebuild's own cost from the machine's: the same loop beside processes that "
            "only compute (no I/O, no lake), in a scheduling group of their own at the lowest priority, as the "
            "rebuild's folds run. Where a control's ratios match the rebuild's, what slows the loop is any work on "
            "the cores at all (its many short waits, Postgres round trips and delta-rs' threads, each wake later: "
            "see the per-pass seconds in the JSON), not the rebuild's design.",
        ],
    }
