"""How far each projection is behind `events`: the `events` version it has folded up to, read from its Delta log.

Every projection records that version in its own commits, as a Delta transaction id (so that a crash never folds a
commit twice); this room reads those ids back, without reading a row, for the health exporter (es_pipeline/health).
A `Lake` keeps its tables open between readings and catches each up with its new log entries only, so that a
reading every few seconds costs a few small file reads, not a table load.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from deltalake import DeltaTable

from es_pipeline.lake import cross_stream
from es_pipeline.lake.aggregates.builtin import EVENT_TYPE_DAILY, STREAM_CATALOG
from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel.position import REVISION_SLOTS
from es_pipeline.lake.state import history, stream_state
from es_pipeline.lake.typed import event_tables

LOOKBACK = 1000  # `events` commits whose times a Lake keeps (read from the log once each)
NAMES_EVERY = 60.0  # seconds between two listings of the lake's cross-stream and history tables


@dataclass(frozen=True)
class Behind:
    """One projection against `events`: the version it folded (None: not built), how many `events` commits it has
    not, and since when the oldest of those waits (0 when none)."""

    name: str
    folded: int | None
    versions: int
    seconds: float


class Lake:
    """The lake's `events` and projections, kept open between readings."""

    def __init__(self, warehouse: Location, grains: Sequence[str] = ("each", "daily:UTC")) -> None:
        self.warehouse = warehouse
        self.grains = tuple(grains)  # a history table's grains to look for (`history.grains_of` the domain)
        self._open: dict[str, DeltaTable] = {}
        self._cross: list[str] = []
        self._history: list[str] = []
        self._cross_listed = -NAMES_EVERY
        self._commits: dict[int, tuple[float, bool]] = {}  # `events` version → (commit time, added events)

    def table(self, name: str) -> DeltaTable | None:
        """The table `name` at its newest version; None while it does not exist."""
        kept = self._open.get(name)
        path = tables.table_path(self.warehouse, name)
        if kept is not None:
            try:
                made_anew = tables.first_commit_id(path) not in (None, str(kept.metadata().id))
                if not made_anew:  # (a folder removed and made again is another table: its log starts over)
                    kept.update_incremental()
                    return kept
            except Exception:  # noqa: BLE001 - replaced, vacuumed under us: open it again below
                pass
            self._open.pop(name, None)
        if not tables.is_delta_table(path):
            return None
        self._open[name] = DeltaTable(path)
        return self._open[name]

    def events_version(self) -> int | None:
        events = self.table("events")
        return None if events is None else int(events.version())

    def commits(self, newest: int) -> dict[int, tuple[float, bool]]:
        """`events`' commits of the last LOOKBACK versions up to `newest`: version → (commit time, whether it added
        events: an extraction's WRITE, not a compaction, an erasure, a property change). Read once each."""
        events = self.table("events")
        have = max(self._commits, default=newest - LOOKBACK)
        if events is not None and newest > have:
            for entry in events.history(limit=min(newest - have, LOOKBACK)):
                v, ts = entry.get("version"), entry.get("timestamp")
                if v is not None and ts is not None:
                    self._commits[int(v)] = (float(ts) / 1000.0, entry.get("operation") == "WRITE")
        for v in [v for v in self._commits if v <= newest - LOOKBACK]:
            del self._commits[v]
        return self._commits

    def cross_stream_names(self) -> list[str]:
        self._list()
        return self._cross

    def history_names(self) -> list[str]:
        self._list()
        return self._history

    def _list(self) -> None:
        if time.monotonic() - self._cross_listed >= NAMES_EVERY:
            self._cross, self._history = cross_stream.table_names(self.warehouse), history.table_names(self.warehouse)
            self._cross_listed = time.monotonic()

    def cursors(self) -> dict[str, tuple[str, str, int] | None]:
        """Where each projection records the `events` version it folded: (the table whose log holds it, the
        transaction's app id, what its version is divided by); None where it cannot be read (not built)."""
        out: dict[str, tuple[str, str, int] | None] = {}
        events = self.table("events")
        if events is None:
            return out
        events_id = str(events.metadata().id)
        out["stream_state"] = ("stream_state", stream_state.app_id(events_id), REVISION_SLOTS)
        for aggregate in (STREAM_CATALOG, EVENT_TYPE_DAILY):
            out[aggregate.name] = (aggregate.name, aggregate.table.app_id_over(events_id), 1)
        for name in self.cross_stream_names():
            t = self.table(name)
            definition = None if t is None else t.metadata().configuration.get(cross_stream.KIND)
            out[name] = None if definition is None else (
                name, cross_stream.app_ids(name, definition, events_id)[1], 1)
        for name in self.history_names():
            # A history table records stream_state's transaction version with its grain's app id: behind while its
            # type is held for a rebuild, or after a crash between the two commits.
            t = self.table(name)
            app = None if t is None else next(
                (a for a in (history.app_id_of(name, events_id, g) for g in self.grains)
                 if t.transaction_version(a) is not None), None)
            out[name] = None if app is None else (name, app, REVISION_SLOTS)
        mapping = self.table(event_tables.NAME)
        conf = {} if mapping is None else mapping.metadata().configuration
        built = conf.get(event_tables.BUILT_FROM) == events_id and conf.get(event_tables.BUILT_FOR) != event_tables.BUILDING
        out[event_tables.NAME] = (event_tables.NAME, event_tables.APP_ID, 1) if built else None
        return out

    def folded(self, cursors: dict[str, tuple[str, str, int] | None] | None = None) -> dict[str, int | None]:
        """Each projection's folded `events` version: the built-in ones, every cross-stream table, the typed event
        tables (their mapping's cursor); None where the projection has not been built from the `events` table the
        lake holds now (not built, or built from another: it is rebuilt at its next update, never up to date)."""
        out: dict[str, int | None] = {}
        for name, cursor in (self.cursors() if cursors is None else cursors).items():
            t = None if cursor is None else self.table(cursor[0])
            v = None if t is None or cursor is None else t.transaction_version(cursor[1])
            out[name] = None if v is None or cursor is None else int(v) // cursor[2]
        return out

    def folds(self, cursor: tuple[str, str, int], after: int, upto: int) -> list[tuple[int, float, int]]:
        """(table version, commit time, folded `events` version) of each commit of a projection's table after version
        `after`, up to `upto`, that moved its cursor (from `cursors()`), read from the commits' own log entries (small
        files, each once). A commit whose log entry is gone (a checkpoint and log cleanup) is left out."""
        fs, root = tables.filesystem(tables.table_path(self.warehouse, cursor[0]))
        out = []
        for version in range(after + 1, upto + 1):
            try:
                with fs.open_input_stream(f"{root}/_delta_log/{version:020d}.json") as f:
                    lines = f.read().decode().splitlines()
            except (FileNotFoundError, OSError):
                continue
            committed, folded = None, None
            for line in lines:
                action = json.loads(line)
                if "commitInfo" in action:
                    committed = action["commitInfo"].get("timestamp")
                elif "txn" in action and action["txn"].get("appId") == cursor[1]:
                    folded = int(action["txn"]["version"]) // cursor[2]
            if committed is not None and folded is not None:
                out.append((version, committed / 1000.0, folded))
        return out

    def behind(self, now: float | None = None,
               cursors: dict[str, tuple[str, str, int] | None] | None = None) -> list[Behind]:
        """Every projection's distance behind `events` now (none before `events` exists): the commits that added
        events it has not folded, and the age of the oldest. A compaction or an erasure adds no event, and
        leaves no projection behind. Where the unfolded commits go back past the last LOOKBACK versions, every
        version counts, and the age is that of the oldest commit known: at least that far behind."""
        newest = self.events_version()
        if newest is None:
            return []
        now = time.time() if now is None else now
        commits = self.commits(newest)
        known_from = min(commits, default=newest + 1)
        out = []
        for name, folded in self.folded(cursors).items():
            first = 0 if folded is None else folded + 1
            if first < known_from:
                oldest = commits[known_from][0] if commits else None
                versions = newest - first + 1
            else:
                pending = [v for v in commits if v >= first and commits[v][1]]
                versions = len(pending)
                oldest = commits[min(pending)][0] if pending else None
            out.append(Behind(name, folded, versions, max(0.0, now - oldest) if oldest is not None else 0.0))
        return out

    def commit_latencies(self, after: int, upto: int) -> list[tuple[int, float, int]]:
        """(version, seconds, rows) of each `events` commit after version `after`, up to `upto`, that added rows: the seconds from
        its oldest event's `recorded_at` (its transaction's start, by the store's clock) to the commit (the lake's
        clock), read from the commit's own log entry and its files' statistics, not from the rows. A commit whose
        log entry is gone (a checkpoint and log cleanup) is left out."""
        events = self.table("events")
        if events is None:
            return []
        fs, root = tables.filesystem(EVENTS.path(self.warehouse))
        out = []
        for version in range(after + 1, min(upto, int(events.version())) + 1):
            try:
                with fs.open_input_stream(f"{root}/_delta_log/{version:020d}.json") as f:
                    lines = f.read().decode().splitlines()
            except (FileNotFoundError, OSError):
                continue
            committed, oldest, rows, appended = None, None, 0, False
            for line in lines:
                action = json.loads(line)
                if "commitInfo" in action:  # an extraction's append; not a compaction, an erasure, a rewrite
                    committed = action["commitInfo"].get("timestamp")
                    appended = action["commitInfo"].get("operation") == "WRITE"
                elif "add" in action and action["add"].get("dataChange", True) and action["add"].get("stats"):
                    stats = json.loads(action["add"]["stats"])
                    rows += int(stats.get("numRecords", 0))
                    first = stats.get("minValues", {}).get("recorded_at")
                    if first is not None:
                        at = datetime.fromisoformat(first.replace("Z", "+00:00")).timestamp()
                        oldest = at if oldest is None else min(oldest, at)
            if appended and committed is not None and oldest is not None and rows:
                out.append((version, max(0.0, committed / 1000.0 - oldest), rows))
        return out
