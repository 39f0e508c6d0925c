"""A person's view of a reading (health/exporter.py): the one line `es-pipeline status` ends with, and the live
view of `es-pipeline status --watch`, refreshed in place."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from es_pipeline.health.exporter import Reader, Reading
from es_pipeline.health.store import Holder

LOOP_DAEMONS = ("SENSOR", "QUEUED_RUN_COORDINATOR", "ASSET")  # the daemons es_pipeline's loop stops without
DAEMON_LATE = 60.0  # seconds without a heartbeat: a daemon is dead (Dagster's own heartbeat is every 30 s)
TICK_LATE = 40.0  # seconds without a tick of a running sensor: its daemon or code server is not working (the alert's bound)
RUN_LATE = 30.0  # seconds extractable events wait without a tailing run (a handoff takes a second or two)
HELD_LATE = 60.0  # seconds a transaction holds the horizon, with events waiting behind it, before it is a problem


def _holder(h: Holder) -> str:
    who = f"pid {h.pid}" if h.pid is not None else "prepared transaction"
    name = f" '{h.application_name}'" if h.application_name else ""
    user = f" as {h.user}" if h.user else ""
    age = f"{h.seconds:.0f} s" if h.seconds is not None else "age unknown to this role"
    return f"{who}{name}{user}, {h.state or 'open'}, {age}"


def problems(r: Reading, *, tailing: bool, intervals: dict[str, float] | None = None) -> list[str]:
    """What is wrong, one short phrase each; empty when everything read is well."""
    out = [f"{part} unreadable ({r.errors.get(part, 'error')})" for part, ok in sorted(r.ok.items()) if not ok]
    s = r.store
    if s is not None:
        if s.source_problem:
            out.append(f"no run would extract: {s.source_problem}")
        waited = max((s.taken_at - x.waiting.oldest_extractable_at for x in s.ranges
                      if x.waiting.oldest_extractable_at), default=0.0)
        if tailing and not all(x.slices_locked == x.slices for x in s.ranges) and waited > RUN_LATE:
            out.append(f"no tailing run holds the slices, and extractable events have waited {waited:.0f} s")
        if s.holder is not None and (s.holder.seconds or 0) > HELD_LATE and any(x.waiting.behind_horizon for x in s.ranges):
            out.append(f"horizon held by {_holder(s.holder)}")
    for table, n in sorted(r.quarantined.items()):
        if n:
            out.append(f"{table}: {n} quarantined (es-pipeline lake quarantined)")
    d = r.dagster
    if d is not None:
        if not d.heartbeats:
            out.append("no Dagster daemon has ever run on this instance")
        for kind, at in sorted(d.heartbeats.items()):
            if kind in LOOP_DAEMONS and d.taken_at - at > DAEMON_LATE:
                out.append(f"Dagster daemon {kind} silent for {d.taken_at - at:.0f} s")
        for t in d.ticks:
            if t.running and t.failed:
                out.append(f"sensor {t.sensor} failing: {t.error or 'see its ticks in the UI'} (code server down?)")
            elif t.running and t.at is not None and d.taken_at - t.at > _tick_late(t.sensor, intervals):
                out.append(f"sensor {t.sensor} has not ticked for {d.taken_at - t.at:.0f} s")
        for f in d.failing:
            where = (f" on stream {f.failure['stream_id']!r} version {f.failure.get('version')}"
                     if f.failure.get("stream_id") else "")
            out.append(f"{f.asset} failing{where} (run {f.run_id[:8]}): {f.error}")
        for run in d.last_runs:
            if run.job == "snapshots_job" and run.status == "FAILURE":
                out.append("the newest snapshots run failed: snapshots are not written back")
    if r.spark_connect is not None and not r.spark_connect[1]:
        out.append(f"Spark Connect at {r.spark_connect[0]} does not answer")
    return out


def _tick_late(sensor: str, intervals: dict[str, float] | None) -> float:
    """The alert's bound: two of the sensor's intervals and 10 s (TICK_LATE where its interval is not known)."""
    interval = (intervals or {}).get(sensor)
    return TICK_LATE if interval is None else 2 * interval + 10


def health_line(r: Reading, *, tailing: bool, intervals: dict[str, float] | None = None) -> str:
    """One line: `health: ok (...)`, or `health: PROBLEM: a; b`."""
    wrong = problems(r, tailing=tailing, intervals=intervals)
    if wrong:
        return "health: PROBLEM: " + "; ".join(wrong)
    seen = []
    if r.store is not None and tailing:
        pids = sorted(r.store.lock_holders)
        seen.append(f"tailing run alive (pid {', '.join(map(str, pids))})" if pids else "no run needed (nothing waits)")
    if r.dagster is not None:
        newest = max(r.dagster.heartbeats.values(), default=None)
        if newest is not None:
            seen.append(f"daemon heartbeat {r.dagster.taken_at - newest:.0f} s ago")
        ticked = [t.at for t in r.dagster.ticks if t.at is not None]
        if ticked:
            seen.append(f"sensor ticked {r.dagster.taken_at - max(ticked):.0f} s ago")
    else:
        seen.append("no Dagster instance configured (DAGSTER_HOME)")
    if r.spark_connect is not None:
        seen.append(f"Spark Connect {r.spark_connect[0]} answering")
    return "health: ok (" + "; ".join(seen) + ")"


def render(r: Reading, *, tailing: bool, throughput: float | None, intervals: dict[str, float] | None = None) -> str:
    lines = [time.strftime("es_pipeline %Y-%m-%d %H:%M:%S") + f"   (reading took {r.seconds * 1000:.0f} ms)", ""]
    s = r.store
    if s is not None:
        lines.append(f"{'range':<10} {'to extract':>11} {'behind H':>9} {'oldest waiting':>15} {'last pass':>10} "
                     f"{'locked':>7}")
        for x in s.ranges:
            oldest = min((t for t in (x.waiting.oldest_extractable_at, x.waiting.oldest_behind_at) if t), default=None)
            waited = f"{s.taken_at - oldest:.0f} s" if oldest else "-"
            last = f"{s.taken_at - x.last_advance:.0f} s ago" if x.last_advance else "never"
            lines.append(f"{x.key:<10} {x.waiting.extractable:>11,} {x.waiting.behind_horizon:>9,} {waited:>15} "
                         f"{last:>10} {x.slices_locked:>3}/{x.slices:<3}")
        lines.append("")
        lines.append(f"horizon {s.horizon}; held by " + (_holder(s.holder) if s.holder else "nothing (no open "
                                                         "transaction with an id)"))
        lines.append(f"pending batches {s.pending_batches}")
    if throughput is not None:
        lines.append(f"into the lake: {throughput:,.1f} events/s")
    if r.behind:
        lines.append("")
        lines.append(f"{'projection':<28} {'behind (commits)':>17} {'behind (s)':>11}")
        for b in r.behind:
            lines.append(f"{b.name:<28} {('not built' if b.folded is None else f'{b.versions:,}'):>17} {b.seconds:>11.0f}")
    if r.rebuilds:
        lines.append("")
        lines.append("rebuilding beside stream_state (the old rows in service until the swap):")
        lines += [f"  {p.line()}" for p in r.rebuilds]
    lines += ["", health_line(r, tailing=tailing, intervals=intervals)]
    return "\n".join(lines)


def watch(reader: Reader, *, interval: float, stop: threading.Event, out: TextIO = sys.stdout,
          rounds: int | None = None) -> None:
    """Redraw `render` every `interval` seconds in place until `stop` (or `rounds` redraws)."""
    tailing = reader.settings.tail_seconds > 0
    last: tuple[float, int] | None = None
    n = 0
    while not stop.is_set() and (rounds is None or n < rounds):
        r = reader.reading(min_interval=0)
        appended = reader.latency.rows
        throughput = None
        if last is not None and r.at > last[0]:
            throughput = (appended - last[1]) / (r.at - last[0])
        last = (r.at, appended)
        clear = "\x1b[H\x1b[2J" if out.isatty() else ""
        out.write(clear + render(r, tailing=tailing, throughput=throughput, intervals=reader.intervals) + "\n")
        out.flush()
        n += 1
        stop.wait(interval)
