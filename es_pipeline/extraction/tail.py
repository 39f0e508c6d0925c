"""A tailing run: one range extracted again and again as commits arrive, for a bounded time. No Dagster here.

A run per batch pays its launch (seconds) and leaves a run record for a few dozen events. A tailing run
stays: after its first pass it waits for the store's `es_events` notifications (every append notifies
at commit) or, at the latest, `poll_seconds` (a NOTIFY can be missed behind a transaction pooler, and a
commit below a still-open transaction becomes extractable only when that one ends); then it asks the
sensor's probe whether any slice of its range has something below the horizon, and only then runs a
pass. Each pass is an ordinary `Extractor.run`: pending batch, Delta txn, offsets; the guarantee and its
tests are those of any run. The slice locks are held from the first pass to the last, so a hand
materialization of the range meanwhile fails fast naming this run. It ends at its deadline; near it, the
sensor has queued the next run, which starts when this one ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import psycopg

from es_pipeline.extraction.extractor import Extractor, ExtractResult
from es_pipeline.extraction.offsets import OffsetSession
from es_pipeline.extraction.probe import probe
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.store.conninfo import connect

CHANNEL = "es_events"
# The run tags of `events` runs (defs/events): every run carries its slice range; a run the sensor starts when
# ES_PIPELINE_TAIL_SECONDS > 0 carries how long it tails (a hand materialization has none and makes one pass).
RANGE_TAG = "es_pipeline/slice_range"
TAIL_TAG = "es_pipeline/tail_seconds"
POLL_SECONDS = 2.0  # at most this long between probes, notifications or not
GATHER_SECONDS = 1.0  # after a notification, this long at least: the commits around it are taken in one pass
PASS_GAP = 2.5  # a pass begins this long after the previous one began, at least: under a steady trickle,
# a pass every 2.5 s (commit→lake p50 ≈ 1.3 s + the pass) instead of one per notification and gathering gap
# (docs/decisions.md, "Tailing runs")


@dataclass
class TailResult:
    passes: int = 0
    rows: int = 0
    probes: int = 0
    last: ExtractResult | None = None


@contextmanager
def notifications(dsn: str) -> Iterator[psycopg.Connection | None]:
    """A connection LISTENing on the store's channel; None where LISTEN is refused (a transaction pooler)."""
    conn = connect(dsn, autocommit=True, application_name="es_pipeline tail")
    try:
        try:
            conn.execute(f"LISTEN {CHANNEL}")
        except psycopg.Error:
            yield None
            return
        yield conn
    finally:
        conn.close()


def wait_for_commits(listener: psycopg.Connection | None, seconds: float, *, gather: float = GATHER_SECONDS) -> None:
    """Until a notification arrives or `seconds` pass; then `gather` seconds, even past `seconds`, that take
    the commits around it into the same pass."""
    if seconds <= 0:
        return
    if listener is None:
        time.sleep(seconds)
        return
    for _ in listener.notifies(timeout=seconds, stop_after=1):
        break
    else:
        return
    time.sleep(max(0.0, gather))
    for _ in listener.notifies(timeout=0.001):  # drain what arrived meanwhile
        pass


def gather_seconds(began: float, now: float, left: float) -> float:
    """Seconds to wait after a notification: GATHER_SECONDS, or up to PASS_GAP after the last pass began,
    but not past the run's deadline (`left` seconds away)."""
    return min(left, max(GATHER_SECONDS, began + PASS_GAP - now))


def tail(
    extractor: Extractor, slice_range: SliceRange, *, run_id: str, seconds: float,
    on_pass: Callable[[ExtractResult], None], poll_seconds: float = POLL_SECONDS,
    clock: Callable[[], float] = time.monotonic, session: OffsetSession | None = None,
    stop: threading.Event | None = None, on_idle: Callable[[], None] | None = None,
) -> TailResult:
    """Passes over `slice_range` for `seconds` after the first: `on_pass` gets each pass that moved events;
    `on_idle` is called after each wait that found nothing to extract (what the caller gathered may be due:
    with the horizon held or the writers quiet, no pass comes to carry it).

    The passes share one `session` (the caller's, or one opened here): its connections, and the slice
    locks, held from the first pass to the last, so a pass repeats none of the first one's checks. `stop`: set
    when the run is asked to stop; the pass in progress ends and commits, and no other begins.
    """
    deadline = clock() + seconds
    began = clock()  # the last pass's start (the caller's first pass has just run)
    out = TailResult()
    with notifications(extractor.dsn) as listener, connect(
        extractor.dsn, autocommit=True, application_name="es_pipeline tail probe"
    ) as probe_conn, nullcontext(session) if session is not None else extractor.session(
        slice_range, run_id
    ) as session:
        while stop is None or not stop.is_set():
            left = deadline - clock()
            if left <= 0:
                break
            wait_for_commits(listener, min(poll_seconds, left), gather=gather_seconds(began, clock(), left))
            if stop is not None and stop.is_set():
                break
            out.probes += 1
            found = probe(probe_conn, extractor.events_source, extractor.consumer)
            if not any(s in found.ready_slices for s in slice_range.slices):
                if on_idle is not None:
                    on_idle()
                continue
            began = clock()
            result = extractor.run(slice_range, run_id=run_id, session=session)
            out.passes += 1
            out.rows += result.rows
            out.last = result
            if result.rows:
                on_pass(result)
    return out


_SUMMED = ("batches", "replayed_batches", "read_seconds", "write_seconds", "total_seconds")


class Reports:
    """A tailing run's passes as materializations of the partitions they brought events to.

    The first pass is reported at once; later ones are gathered and reported together at most every `gap`
    seconds (ES_PIPELINE_REPORT_SECONDS), and at the end: one materialization per partition per report, its `rows` the
    partition's rows since the last report, `passes` how many passes that covers, `last_pass` the number of
    the newest. A pass every few seconds reported on its own cost the run, the Dagster daemon and the
    store's database more CPU than extracting it (eight partitions, eight events in Dagster's log a pass);
    the lake itself is no less fresh for it."""

    def __init__(self, keys: list[str], gap: float) -> None:
        self.keys, self.gap = keys, gap
        self.passes = 0
        self.rows: dict[str, int] = {}
        self.gathered = 0
        self.newest: ExtractResult | None = None
        self.sums: dict[str, float] = {}
        self.last = -float("inf")

    def add(self, result: ExtractResult) -> bool:
        """Count a pass in; whether its report is due now (`flush` it then): the first pass's at once, later
        ones once `gap` seconds have passed since the last report."""
        self.passes += 1
        self.gathered += 1
        self.newest = result
        for name in _SUMMED:
            self.sums[name] = self.sums.get(name, 0) + getattr(result, name)
        for key, rows in _rows_per_partition(result, self.keys).items():
            self.rows[key] = self.rows.get(key, 0) + rows
        return self.due()

    def due(self) -> bool:
        """Passes gathered whose report is due (the gap since the last is over)."""
        return self.gathered > 0 and time.monotonic() - self.last >= self.gap

    def flush(self) -> dict[str, dict[str, Any]]:
        """The report due now: per partition key, its figures (and forget them)."""
        out = {}
        if self.newest is not None and self.rows:
            # The newest pass's horizon, watermarks and lag; the work (batches, seconds) of all gathered passes.
            common = {**self.newest.metadata(), **{name: round(v, 3) if isinstance(v, float) else v
                                                   for name, v in self.sums.items()},
                      "passes": self.gathered, "last_pass": self.passes}
            out = {key: {**common, "dagster/row_count": rows, "rows": rows} for key, rows in self.rows.items()}
        self.rows, self.gathered, self.newest, self.sums = {}, 0, None, {}
        self.last = time.monotonic()
        return out


def _rows_per_partition(result: ExtractResult, keys: list[str]) -> dict[str, int]:
    """The pass's rows by partition key (ranges without rows left out). A pass with a batch read by Spark's
    executors did not count every row by slice: then every partition is reported with the pass's whole count."""
    if result.uncounted_rows or not result.rows_by_slice:
        return {key: result.rows for key in keys} if result.rows else {}
    out = {}
    for key in keys:
        part = SliceRange.from_key(key)
        rows = sum(n for s, n in result.rows_by_slice.items() if s in part)
        if rows:
            out[key] = rows
    return out
