"""`Projection`: what a kind of table built from `events` gives the runner (lake/kernel/runner.py), and nothing of the
bookkeeping: its table, the columns of `events` it reads, how its position encodes a commit, how a change-feed
increment folds onto its rows, its whole build in process and its update on Spark. The runner owns the position,
the turn, the engine rule and the order of confirm and commit.

Its kinds (decision 0049): the aggregates (lake/aggregates/aggregate.py), `stream_state` (lake/state/stream_state.py),
cross-stream projections (lake/cross_stream.py), the typed event tables (lake/typed/event_tables.py) and the
snapshots, whose position is over `stream_state` (lake/state/snapshots.py). Every kind says what its update did with the one `Result` (lake/kernel/result.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import pyarrow as pa
from deltalake import DeltaTable

from es_pipeline.lake.delta.definition import Table
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.kernel.feed import Feed
from es_pipeline.lake.kernel.position import Position
from es_pipeline.lake.kernel.result import Result
from es_pipeline.lake.kernel.turn import Turn

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@dataclass(frozen=True)
class Increment:
    """One increment under way: the table (`target`, at `path`) at its `position`, and `events`' change feed."""

    warehouse: Location
    path: str
    target: DeltaTable
    position: Position
    feed: Feed
    upto: int | None = None  # the last `events` version of this window (None: the feed's)

    @property
    def now(self) -> int:
        """The `events` version the increment brings the table to."""
        return self.feed.version if self.upto is None else self.upto

    @property
    def previous(self) -> int:
        """The `events` version the table held."""
        folded = self.position.events_version
        assert folded is not None
        return folded


class Folded(Protocol):
    """An increment folded, ready to commit."""

    def commit(self, txn: int) -> Result:
        """Write the folded rows in one commit that moves the position to txn version `txn` (with no rows, the position
        alone: an empty commit); what the update did."""


class Kind:
    """What most kinds share (a kind inherits it and overrides where it differs): a position over `events`, plain,
    nothing to read before the lake, and an increment whenever the table has a position of this `events`."""

    source: ClassVar[Table] = EVENTS
    increments: ClassVar[bool] = True
    slots: ClassVar[int] = 1
    keeps_cursor: ClassVar[bool] = False
    window: ClassVar[int | None] = None
    increments_in_process: ClassVar[bool] = False

    table: Table

    def app_id(self, events_id: str) -> str:
        """The app id its position is kept under, over the `events` table of Delta id `events_id`."""
        return self.table.app_id_over(events_id)

    def start(self) -> None:
        """Read what must be read before the lake, in the table's turn (a cross-stream projection's batch frontier)."""

    def open(self, path: str) -> DeltaTable:
        """Its table at `path`, at its latest version (a kind that keeps it open between updates gives that one)."""
        return DeltaTable(path)

    def takes_increment(self, position: Position, now: int) -> bool:
        """Whether the table at `position` takes an increment to `events` version `now` (else it is built whole)."""
        return True

    def txn(self, increment: Increment) -> int:
        """The txn version of the commit that brings the table to `increment.now`: that `events` version, plain."""
        return increment.now


class Whole(Protocol):
    """What the runner's update (`runner.update`) asks of every kind: its table, the table its position is over, its
    whole build in process and its update on Spark."""

    @property
    def table(self) -> Table: ...

    @property
    def name(self) -> str: ...

    @property
    def source(self) -> Table:
        """The table its position is over: `events` (lake/events.py), or `stream_state` for the snapshots."""

    @property
    def increments(self) -> bool:
        """Whether it folds an increment of its source's change feed (a `Projection`); else every update is whole
        (the snapshots compare all of `stream_state` with the latest snapshots, bounded by their own rule)."""

    def build_here(self, warehouse: Location, turn: Turn, engine: Engine) -> Result | None:
        """A whole build in this process (the runner asks only within the engine rule's bound over its source's
        files), or None: Spark's after all (a table delta-rs should not write, a bound of the kind's own), or the
        table was built from this `events` already (an increment the runner left to Spark)."""

    def update_on_spark(self, spark: SparkSession, warehouse: Location, turn: Turn) -> Result:
        """The update on Spark: the increment, or the whole build."""


class Projection(Protocol):
    @property
    def table(self) -> Table: ...

    @property
    def name(self) -> str: ...

    @property
    def source(self) -> Table: ...

    @property
    def columns(self) -> tuple[str, ...] | list[str]:
        """The columns of `events` its fold reads."""

    @property
    def slots(self) -> int:
        """Transaction versions per `events` version (lake/kernel/position.py): 1, or `REVISION_SLOTS`."""

    @property
    def keeps_cursor(self) -> bool:
        """Whether its position also keeps a cursor and a frontier (lake/kernel/position.py `Position`)."""

    @property
    def window(self) -> int | None:
        """`events` commits folded and committed at a time (None: the whole increment at once)."""

    def app_id(self, events_id: str) -> str:
        """The app id its position is kept under, over the `events` table of Delta id `events_id`."""

    @property
    def increments_in_process(self) -> bool:
        """Whether its increment runs in this process whatever the engine (the engine then decides its whole build
        alone): True for the kinds whose increment Spark has no path for."""

    def start(self) -> None:
        """Read what must be read before the lake, in the table's turn."""

    def open(self, path: str) -> DeltaTable:
        """Its table at `path`, at its latest version."""

    def takes_increment(self, position: Position, now: int) -> bool:
        """Whether the table at `position` takes an increment to `events` version `now` (else it is built whole)."""

    def ready(self, path: str, target: DeltaTable, events_id: str) -> DeltaTable | None:
        """The table an increment folds onto (brought to this release's columns where that is cheap), or None: it is
        to be built whole, or its increment is Spark's (a table of an older release, deletion vectors)."""

    def up_to_date(self, target: DeltaTable, position: Position, now: int) -> Result:
        """What an update that found nothing new says (`target` at `position`, `events` read at version `now`)."""

    def txn(self, increment: Increment) -> int:
        """The txn version of the commit that brings the table to `increment.now`."""

    def fold(self, rows: pa.Table, increment: Increment) -> Folded:
        """The increment's `rows` (the change feed's, in `columns`) folded, ready to commit."""


class Buildable(Whole, Projection, Protocol):
    """A kind whose every update the runner runs (`runner.update`), its increments too."""
