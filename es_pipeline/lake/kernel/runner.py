"""The runner: one update of a table built from `events`, for every kind (lake/kernel/projection.py `Projection`).

It checks that `events` exists, takes the table's turn (lake/kernel/turn.py), reads the table's position
(lake/kernel/position.py) and `events`' change feed (lake/kernel/feed.py), has the kind fold the new rows, confirms
the turn and has the rows committed with the new position (or the position alone), and returns how far the table
got. What the change feed cannot give (a first build, an increment past `feed.SMALL_INCREMENT`, a feed vacuumed
away) goes to the kind's whole build in process, or to Spark, by the engine rule.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import cast

from deltalake import DeltaTable

from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.kernel.feed import Feed, new_rows
from es_pipeline.lake.kernel.position import Position
from es_pipeline.lake.kernel.projection import Increment, Projection, Whole
from es_pipeline.lake.kernel.result import Result
from es_pipeline.lake.kernel.turn import Turn, one_at_a_time

log = logging.getLogger(__name__)


def update(projection: Whole, engine: Engine, warehouse: Location, *, store_dsn: str | None = None) -> Result:
    """Bring `projection`'s table up to `events` now, one update at a time with `store_dsn`, where `engine` says: a
    small increment, and a whole build within the engine rule's bound (`Engine.on_spark`, over the files of the
    kind's source), run in this process unless the engine says Spark (`Engine.increments_here`); a kind whose increment always runs here (`Projection.increments_in_process`)
    asks the engine only for its whole build; a kind without increments (`Whole.increments`) is built whole each
    time. Without Spark, everything runs here. `NoEventsYet` before `events` exists."""
    if projection.source is EVENTS:
        tables.require_events(warehouse, projection.name)
    here = engine.increments_here
    with one_at_a_time(store_dsn, projection.name) as turn:
        folds = cast(Projection, projection)  # a kind with increments is a `Projection` (lake/kernel/projection.py)
        if projection.increments and (here or folds.increments_in_process):
            done, stopped = _increment(folds, warehouse, turn)
            if done is not None and not stopped:
                return done
        source = projection.source.path(warehouse)
        if (here or not engine.has_spark) and not engine.on_spark(lambda: _files_bytes(source)):
            done = projection.build_here(warehouse, turn, engine)
            if done is not None:
                return done
        return projection.update_on_spark(engine.session(), warehouse, turn)


def _files_bytes(path: str) -> int:
    """The bytes of the current files of the table at `path` (none there: 0), for the engine rule."""
    return tables.files_bytes(DeltaTable(path)) if tables.is_delta_table(path) else 0


def increment(projection: Projection, warehouse: Location, turn: Turn,
              events_feed: Feed | None = None) -> Result | None:
    """The change feed's new rows folded in this process and committed with the position, in `turn`; None: not an
    increment to do here (a first build, a table of another `events` or an older release, more than
    `feed.SMALL_INCREMENT` new events, a feed vacuumed away). A kind that folds a window of commits at a time
    (`Projection.window`) may stop at a window whose feed is gone: its result then says it is short of `events`.
    `events_feed`: one shared with other tables' increments (a tailing run's), else read here."""
    return _increment(projection, warehouse, turn, events_feed)[0]


def _increment(projection: Projection, warehouse: Location, turn: Turn,
               events_feed: Feed | None = None) -> tuple[Result | None, bool]:
    """`increment`, and whether it stopped short at a window whose feed is gone (a whole build goes on from there)."""
    projection.start()  # before the lake is read (also for the whole build that follows a None)
    events_path, path = projection.source.path(warehouse), projection.table.path(warehouse)
    if not tables.is_delta_table(path) or not tables.is_delta_table(events_path):
        return None, False
    events_feed = events_feed or Feed(events_path, list(projection.columns))
    found = projection.open(path)
    now = events_feed.version
    position = Position.of(found, projection.app_id(events_feed.table_id), slots=projection.slots,
                           cursor=projection.keeps_cursor)
    if position.read is None or not projection.takes_increment(position, now):
        return None, False  # a first build, one from another `events`, or one the kind asks for
    target = projection.ready(path, found, events_feed.table_id)
    if target is None:
        return None, False
    if not position.behind(now):
        return projection.up_to_date(target, position, now), False
    done: Result | None = None
    while position.behind(now):
        after = position.folded
        assert after is not None
        if projection.window is None:  # the whole increment at once, from the feed shared by a follow
            upto, rows = now, events_feed.rows(after, list(projection.columns))
        else:  # a window of commits at a time, each committed: memory for one window, however far behind
            upto = min(now, after + projection.window)
            rows = new_rows(events_feed.table, after, upto, list(dict.fromkeys([*projection.columns, "_commit_version"])),
                            whole=True)
        if rows is None:
            if done is None:
                return None, False
            log.info("%s: events' change feed after version %s cannot be read: short of version %s", projection.name,
                     after, now)
            return replace(done, short=f"events' change feed after version {after} cannot be read (vacuumed): "
                                       "a whole build goes on from there"), True
        step = Increment(warehouse, path, target, position, events_feed, upto)
        folded = projection.fold(rows, step)
        turn.confirm(path, position.app_id, position.read)
        txn = projection.txn(step)
        done = folded.commit(txn)
        if projection.window is None:
            break
        position = position.moved(txn)
    return done, False


def retry(projection: Projection, warehouse: Location, *, store_dsn: str | None = None) -> Result | None:
    """The table's held rows (streams or keys quarantined: docs/decisions/0051) folded again now with the code as
    deployed, though no event is new: the kind's fold given none (it folds its held rows' waiting events, as every
    increment does), committed at the position the table holds, in its turn. None: not one to do here (not built,
    another `events`, behind `events`: an update folds the new events and retries them too)."""
    events_path, path = projection.source.path(warehouse), projection.table.path(warehouse)
    if not tables.is_delta_table(path) or not tables.is_delta_table(events_path):
        return None
    with one_at_a_time(store_dsn, projection.name) as turn:
        projection.start()
        events_feed = Feed(events_path, list(projection.columns))
        found = projection.open(path)
        now = events_feed.version
        position = Position.of(found, projection.app_id(events_feed.table_id), slots=projection.slots,
                               cursor=projection.keeps_cursor)
        if position.read is None or not projection.takes_increment(position, now) or position.behind(now):
            return None
        target = projection.ready(path, found, events_feed.table_id)
        if target is None:
            return None
        step = Increment(warehouse, path, target, position, events_feed, now)
        folded = projection.fold(events_feed.none(list(projection.columns)), step)
        turn.confirm(path, position.app_id, position.read)
        return folded.commit(projection.txn(step))
