"""A table's position: how far into `events` it has folded, as Delta holds it, in the same commit as the rows.

Every table built from `events` records its position as a Delta transaction (`txnAppId`/`txnVersion`) in the commit
that writes its rows: a retry or a crash never folds an event twice, and an update that finds the position moved
under it commits nothing (lake/kernel/turn.py `confirm`). The app id names the `events` table folded
(lake/delta/definition.py `over`): a table built from another `events` (recreated, restored) has no position there,
and is built whole. The transaction version encodes the `events` version folded, times `slots`; a kind whose rows
also depend on its code's revision (`stream_state`: the reducers' revisions) keeps that revision in the slots.

Only here are positions read, encoded and turned into commit properties.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from deltalake import CommitProperties, DeltaTable, Transaction

from es_pipeline.lake.delta import tables

log = logging.getLogger(__name__)

# The Delta txn version of a stream_state commit encodes the events table version folded and the
# sum of the reducer revisions, so that a revision bump with no new events still commits (Delta
# skips a txn version it has seen) while a replay of the same work does not.
REVISION_SLOTS = 1000


class Revised(Protocol):
    @property
    def revision(self) -> int: ...


def txn_version(events_version: int, registry: Mapping[str, Revised]) -> int:
    return events_version * REVISION_SLOTS + min(REVISION_SLOTS - 1, sum(r.revision for r in registry.values()))


def next_txn_version(events_version: int, registry: Mapping[str, Revised], read: int | None) -> int:
    """The txn version of a commit at `events_version` after one of txn version `read`: `txn_version`, unless that
    is not above `read` at the same events version (a reducer removed: the sum went down, and Delta would skip the
    commit as done), then one above `read`, within that events version's slots."""
    version = txn_version(events_version, registry)
    if read is not None and version <= read and read // REVISION_SLOTS == events_version:
        version = min(read + 1, events_version * REVISION_SLOTS + REVISION_SLOTS - 1)
    return version


def txn_version_after(read: int, events_version: int) -> int:
    """The txn version of a commit at `events_version` by the reducers that committed txn version `read`."""
    return events_version * REVISION_SLOTS + read % REVISION_SLOTS


@dataclass(frozen=True)
class Position:
    """What a table has folded: the txn version `read` its commits recorded under `app_id` (None: nothing of this
    `events`), in `slots` per `events` version (1: a plain version; `REVISION_SLOTS`: with its code's revision).

    A kind that folds only part of what it read (a cross-stream projection holds back the batches at or above its
    frontier: lake/cross_stream.py) also keeps, under `<app_id>.cursor`, the `events` version every row up to which
    is folded, and under `<app_id>.frontier` the batch id below which the rows after the cursor are."""

    app_id: str
    read: int | None
    slots: int = 1
    cursor: int | None = None
    frontier: int | None = None

    @classmethod
    def of(cls, table: DeltaTable | str, app_id: str, *, slots: int = 1, cursor: bool = False) -> Position:
        """The position of `table` (a DeltaTable, or a path: no table there is no position); `cursor`: with its
        cursor and frontier."""
        if isinstance(table, str):
            if not tables.is_delta_table(table):
                return cls(app_id, None, slots)
            table = DeltaTable(table)
        ids = (app_id, f"{app_id}.cursor", f"{app_id}.frontier") if cursor else (app_id,)
        read, held, frontier = (*(table.transaction_version(a) for a in ids), None, None)[:3]
        as_int = lambda v: None if v is None else int(v)  # noqa: E731
        return cls(app_id, as_int(read), slots, as_int(held), as_int(frontier))

    @property
    def ids(self) -> tuple[str, ...]:
        """The app ids this position is kept under."""
        return (self.app_id,) if self.cursor is None else (self.app_id, f"{self.app_id}.cursor",
                                                            f"{self.app_id}.frontier")

    @property
    def events_version(self) -> int | None:
        """The `events` version read up to (None: none)."""
        return None if self.read is None else self.read // self.slots

    @property
    def folded(self) -> int | None:
        """The `events` version every row up to which is folded: the cursor where the kind keeps one."""
        return self.cursor if self.cursor is not None else self.events_version

    def behind(self, events_version: int) -> bool:
        """Whether `events` at `events_version` holds commits this position has not folded (or it has none)."""
        folded = self.folded
        return folded is None or folded < events_version

    def moved(self, read: int, *, cursor: int | None = None, frontier: int | None = None) -> Position:
        """This position after a commit that reads up to txn version `read` (with its new `cursor` and `frontier`,
        where it keeps them)."""
        return Position(self.app_id, read, self.slots, cursor, frontier)

    def commit(self, txn: int | None = None) -> CommitProperties:
        """The commit properties of a commit that records this position (or, given `txn`, moves its one app id
        there)."""
        if txn is not None:
            return commit_properties(self.app_id, txn)
        assert self.read is not None
        if self.cursor is None:
            return commit_properties(self.app_id, self.read)
        assert self.frontier is not None
        return marks(zip(self.ids, (self.read, self.cursor, self.frontier), strict=True))


def commit_properties(app_id: str, version: int) -> CommitProperties:
    return CommitProperties(app_transactions=[Transaction(app_id, version)])


def marks(pairs: Iterable[tuple[str, int]]) -> CommitProperties:
    """The commit properties that record each (app id, txn version) of `pairs` in one commit."""
    return CommitProperties(app_transactions=[Transaction(a, int(v)) for a, v in pairs])


def record(table: DeltaTable, properties: CommitProperties, *, partition_by: list[str] | None = None) -> None:
    """A commit of no rows that records `properties` alone: a position moved past events that changed no row, a
    mark. The one place that writes such a commit."""
    table.create_write_transaction([], mode="append", schema=table.schema(), partition_by=partition_by,
                                   commit_properties=properties)


FENCE = 2**62  # a position past any `events` version


def fence_older(path: str, positions: Sequence[tuple[str, int]]) -> None:
    """Before a whole build of a table that an older es_pipeline kept under unbound app ids (lake/delta/definition.py `over`):
    those ids set to `positions` (FENCE: "nothing new"), so that an older release still running (a tailing run
    started before the upgrade) finds nothing to fold there, rather than merging its increments from its old
    position onto the rows rebuilt; its update under way finds its position moved and commits nothing
    (lake/kernel/turn.py `confirm`). A table without them (new, or fenced already) is left as it is."""
    if not tables.is_delta_table(path):
        return
    table = DeltaTable(path)
    todo = [(a, v) for a, v in positions if (held := table.transaction_version(a)) is not None and held != v]
    if not todo:
        return
    try:
        record(table, marks(todo))
    except Exception as exc:  # noqa: BLE001 - a table delta-rs will not write (its features): the build goes on
        log.warning("%s: could not fence the positions of an older es_pipeline (%s)", path, exc)
