"""A tailing run's increments of every table built from `events`, and their bookkeeping (no Dagster here).

A tailing `events` run (extraction/tail.py) keeps the tables fresh between the automation's runs:
`follow` takes every table's small increment from one read of `events`' change feed, each in its own turn;
`Follower` calls it at most every `gap` seconds (ES_PIPELINE_FOLLOW_SECONDS) and before each report of `events`,
and hands over for the run to report, right after that report, every table the follow covered (updated, or found
up to date). What needs Spark, a whole build, or fails, is left to the automation's runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from es_pipeline.domain import Domain
from es_pipeline.lake import projections
from es_pipeline.lake.cross_stream import Frontier
from es_pipeline.lake.delta import tables
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel.feed import Feed
from es_pipeline.lake.kernel.result import Result
from es_pipeline.lake.kernel.turn import turn_if_free

_GATHERED = ("events_folded", "keys_updated", "streams_updated", "keys_refolded",
             "overflow_values")  # summed over gathered updates


def follow(
    warehouse: tables.Location, store: str | psycopg.Connection, domain: Domain, frontier: Frontier | None = None,
) -> dict[str, Result]:
    """Every projection's small increment now, each in its turn (a tailing `events` run keeps them fresh
    this way), from one read of `events`' change feed, in the order of `projections.of(domain)`: `stream_state`,
    the built-in aggregates, `domain`'s cross-stream projections (up to `frontier`, lake/cross_stream.py), then the
    typed event tables. A projection whose turn another update holds, or that needs Spark or a whole build, is left
    out: its automation's run does it. `store`: the store's DSN, or a `lock_transaction` connection kept for the
    turns."""
    events_path = EVENTS.path(warehouse)
    if not tables.is_delta_table(events_path):
        return {}
    if frontier is not None and domain.projections:  # read before the lake (lake/cross_stream.py)
        read_first = frontier()
        frontier = lambda: read_first  # noqa: E731 - the one value read, for every projection of this follow
    plugins = projections.of(domain)
    events_feed = Feed(events_path, [c for plugin in plugins for c in plugin.columns])
    done: dict[str, Result] = {}
    for plugin in plugins:
        with turn_if_free(store, plugin.name) as turn:
            result = None if turn is None else plugin.increment(warehouse, turn, events_feed, frontier)
        if result is not None:
            done[plugin.name] = result
    return done


class Follower:
    """The tables a tailing run keeps fresh, and what it has to report of them: `update` follows (at most every
    `gap` seconds unless forced); `flush`, right after a report of `events` (and at the run's end, after its own
    materialization of `events`), hands over each table the latest follow covered: the gathered figures of one
    it updated, the figures of one it found up to date. One materialization each: logged after `events`', it
    tells the automation (defs/projections/assets.py, AFTER_EVENTS) that the table is not behind it.

    A table the latest follow skipped (its turn taken, Spark needed) keeps its figures for a later report: reported
    after this report of `events`, they would say it had kept up with events it has not folded.

    `connect` opens the connection the turns are taken on (kept for the run); `frontier(conn)` reads the batch
    frontier on it. A follow that fails stops following for the run, and drops what it had gathered: nothing
    more is reported, so the tables are behind `events`, and the automation's run comes (and fails where its
    alert sees it, when the failure is a reducer's)."""

    def __init__(self, warehouse: tables.Location, domain: Domain, connect: Callable[[], psycopg.Connection],
                 frontier: Callable[[psycopg.Connection], int], gap: float) -> None:
        self.warehouse, self.domain, self.connect, self.frontier = warehouse, domain, connect, frontier
        self.gap = gap  # seconds between two follows at least; 0: after every pass that moved events
        self.last = 0.0
        self.failed = False
        self.conn: psycopg.Connection | None = None
        self.pending: dict[str, dict[str, Any]] = {}
        self.updated: set[str] = set()  # tables the latest follow folded events into, not yet handed over
        self.up_to_date: dict[str, dict[str, Any]] = {}  # tables it found with nothing to fold, not yet handed over

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

    def update(self, *, force: bool = False) -> None:
        """Follow now, if due (or `force`d). Raises what the follow raised, once: the follower stops then."""
        if self.failed or (not force and time.monotonic() - self.last < self.gap):
            return
        self.last = time.monotonic()
        try:
            if self.conn is None or self.conn.closed:
                self.conn = self.connect()
            conn = self.conn
            done = follow(self.warehouse, conn, self.domain, lambda: self.frontier(conn))
        except Exception:
            self.failed, self.pending, self.updated, self.up_to_date = True, {}, set(), {}
            raise
        self.up_to_date = {}  # from this follow only: a table skipped since (its turn taken, Spark) is not
        self.updated = set()
        for name, result in done.items():
            metadata: dict[str, Any] = result.metadata()
            if result.worked:
                self._gather(name, metadata)
            if not result.caught_up:  # short of events (a feed it could not read, events held for the frontier):
                continue              # reported now, it would say it kept up; the automation's run takes it
            if result.worked:
                self.updated.add(name)
            else:
                self.up_to_date[name] = metadata

    def _gather(self, name: str, metadata: dict[str, Any]) -> None:
        """The newest update's figures; the work (events, keys) and count of all gathered updates."""
        before = self.pending.get(name, {})
        for key in _GATHERED:
            if key in metadata:
                metadata[key] += before.get(key, 0)
        self.pending[name] = {**metadata, "updates": before.get("updates", 0) + 1}

    def flush(self) -> dict[str, dict[str, Any]]:
        """Per table the latest follow covered, its figures to report now (and forget): the gathered ones of a
        table it updated, `up_to_date` for one it found with nothing to fold."""
        out = {name: self.pending.pop(name, {}) or {**self.up_to_date[name], "up_to_date": True}
               for name in sorted(self.updated | self.up_to_date.keys())}
        self.updated, self.up_to_date = set(), {}
        return out
