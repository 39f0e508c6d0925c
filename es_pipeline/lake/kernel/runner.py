"""The runner: one update of a table built from `events`, for every kind (lake/kernel/projection.py `Projection`).

It checks that `events` exists, takes the table's turn (lake/kernel/turn.py), reads the table's position
(lake/kernel/position.py) and `events`' change feed (lake/kernel/feed.py), has the kind fold the new rows, confirms
the turn and has the rows committed with the new position (or the position alone), and returns how far the table
got. What the change feed cannot give (a first build, an increment past `feed.SMALL_INCREMENT`, a feed vacuumed
away) goes to the kind's whole build in process, or to Spark, by the engine rule.
"""

from __future__ import annotations

from typing import Any, TypeVar

from deltalake import DeltaTable

from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel.feed import Feed
from es_pipeline.lake.kernel.position import Position
from es_pipeline.lake.kernel.projection import Buildable, Increment, Projection, Reported
from es_pipeline.lake.kernel.turn import Turn, one_at_a_time

R = TypeVar("R", bound=Reported)


def update(projection: Buildable[R], spark: Any, warehouse: Location, *, store_dsn: str | None = None,
           small_increments: bool = True, engine: str = "auto") -> R:
    """Bring `projection`'s table up to `events` now, one update at a time with `store_dsn`.

    `spark`: a session, or a function that returns one, called only if Spark is needed: a small increment, and a
    whole build within the engine rule's bound, run in this process unless told not to (`small_increments`, or
    `engine` "spark"). `NoEventsYet` before `events` exists."""
    tables.require_events(warehouse, projection.name)
    with one_at_a_time(store_dsn, projection.name) as turn:
        if small_increments and engine != "spark":
            done = increment(projection, warehouse, turn) or projection.build_here(warehouse, turn, engine)
            if done is not None:
                return done
        return projection.update_on_spark(tables.session_of(spark), warehouse, turn)


def increment(projection: Projection[R], warehouse: Location, turn: Turn,
              events_feed: Feed | None = None) -> R | None:
    """The change feed's new rows folded in this process and committed with the position, in `turn`; None: not an
    increment to do here (a first build, a table of another `events` or an older release, more than
    `feed.SMALL_INCREMENT` new events, a feed vacuumed away). `events_feed`: one shared with other tables' increments
    (a tailing run's), else read here."""
    projection.start()  # before the lake is read (also for the whole build that follows a None)
    events_path, path = EVENTS.path(warehouse), projection.table.path(warehouse)
    if not tables.is_delta_table(path) or not tables.is_delta_table(events_path):
        return None
    events_feed = events_feed or Feed(events_path, list(projection.columns))
    found = DeltaTable(path)
    now = events_feed.version
    position = Position.of(found, projection.table.app_id_over(events_feed.table_id), slots=projection.slots,
                           cursor=projection.keeps_cursor)
    if position.read is None or not projection.takes_increment(position, now):
        return None  # a first build, one from another `events`, or one the kind asks for
    target = projection.ready(path, found)
    if target is None:
        return None
    if not position.behind(now):
        return projection.up_to_date(target, position, now)
    assert position.folded is not None
    rows = events_feed.rows(position.folded, list(projection.columns))
    if rows is None:
        return None
    step = Increment(warehouse, path, target, position, events_feed)
    folded = projection.fold(rows, step)
    turn.confirm(path, position.app_id, position.read)
    return folded.commit(projection.txn(step))
