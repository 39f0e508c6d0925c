"""`es-pipeline lake rebuild`: a table of the lake built again from what it is built from, in one command.

- `events`: built again from the store. Under every slice lock (refused, nothing changed, while a run extracts),
  every event of the lake must be in the store, by key and `recorded_at`: one that is not (the store restored from
  an older state, a failover that lost commits) would be lost with the table, so the rebuild is refused
  (`RebuildRefused`) unless the operator accepts that loss. Then the table is removed and the consumer's offsets
  reset, in that order (a crash between leaves offsets without a table, which the next run refuses, and this
  command, run again, finishes). The next runs extract every event once; each projection then finds no position
  under the new `events` (lake/delta/definition.py `over`) and builds itself whole at its next update.
- a projection (`stream_state` with its typed state and history tables, `stream_catalog`, `event_type_daily`, a cross-stream
  table, the typed event tables through their mapping `event_tables`, `snapshots`): removed in its own turn
  (lake/kernel/turn.py), so that no update of it runs meanwhile; its next update builds it whole from `events` (the
  typed state tables follow a new `stream_state` the same way). Nothing is lost: each is a fold of `events`.
  `snapshots` is the record of what was written back: it is taken again from `stream_state` at its next run, and
  the store's snapshots are upserted, not doubled.

Nothing here needs Spark or Dagster: the next runs do the building.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from es_pipeline.errors import RebuildRefused, UnknownLakeTable
from es_pipeline.extraction import offsets
from es_pipeline.extraction.offsets import OffsetSession
from es_pipeline.extraction.rebase import lake_not_in_store
from es_pipeline.extraction.slices import NUM_SLICES
from es_pipeline.lake import inventory
from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.kernel import dead_letters
from es_pipeline.lake.kernel.turn import one_at_a_time
from es_pipeline.source.mapping import Source

EVENTS = "events"


@dataclass(frozen=True)
class Rebuilt:
    """What `lake rebuild` did: the tables removed (to be built again), and for `events` the events it held and
    the watermarks forgotten."""

    removed: list[str]
    lake_events: int = 0
    lost_events: int = 0  # events of the lake the store does not hold, removed because the operator accepted it
    forgotten_slices: int = 0


def rebuildable(warehouse: Location) -> list[str]:
    """The tables `lake rebuild` takes: `events` and every projection the lake holds now (a typed table goes with
    its source: a typed state table with `stream_state`, a typed event table with the mapping; `_dead_letters` is
    no projection: its rows follow the tables it lists)."""
    return [name for name in inventory.lake_tables(warehouse) if inventory.turn_of(name) == name
            and name != dead_letters.NAME]


def rebuild(
    dsn: str, source: Source, warehouse: Location, names: Sequence[str], *, accept_loss: bool = False,
    say: Callable[[str], None] = print,
) -> Rebuilt:
    """Rebuild `names` (module docstring): `events` first where named, then each projection. An unknown name is
    refused before anything is touched."""
    known = rebuildable(warehouse)
    unknown = [n for n in names if n not in known and n != EVENTS]
    if unknown:
        raise UnknownLakeTable(unknown, known)
    done = Rebuilt([])
    if EVENTS in names:
        done = _rebuild_events(dsn, source, warehouse, accept_loss=accept_loss, say=say)
    for name in names:
        if name == EVENTS:
            continue
        path = tables.table_path(warehouse, name)
        with one_at_a_time(dsn, name):
            tables.remove_folder(path)
        done.removed.append(name)
        say(f"removed {name} ({path}): its next update builds it whole from `events`")
    return done


def _rebuild_events(dsn: str, source: Source, warehouse: Location, *, accept_loss: bool,
                    say: Callable[[str], None]) -> Rebuilt:
    path = tables.table_path(warehouse, EVENTS)
    consumer = source.consumer
    with OffsetSession(dsn, consumer, run_id="lake-rebuild", label="lake rebuild", source=source) as session:
        session.lock(range(NUM_SLICES), "all slices")
        keys = tables.event_keys(path)
        missing, _ = lake_not_in_store(keys, dsn, source)
        if missing.num_rows and not accept_loss:
            raise RebuildRefused(path, missing.num_rows, tables.key_label(missing, 0))
        say(f"events ({path}): {keys.num_rows:,} events, "
            + (f"{missing.num_rows:,} of them not in the store, removed as accepted" if missing.num_rows
               else "every one in the store"))
        with one_at_a_time(dsn, EVENTS):  # no compaction or erasure of the table meanwhile
            tables.remove_folder(path)
        forgotten = offsets.reset(session.conn, consumer)
    say(f"removed events and forgot {forgotten} slice watermarks of consumer {consumer!r}: the next runs extract "
        "every event of the store once; each projection rebuilds itself at its next update")
    return Rebuilt([EVENTS], keys.num_rows, missing.num_rows, forgotten)
