"""Every table es_pipeline keeps in a lake, and the turn (lake/kernel/turn.py) each is written in: what maintenance
compacts, the catalog registers and a tenant's erasure deletes from."""

from __future__ import annotations

from es_pipeline.lake import cross_stream
from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.kernel import dead_letters
from es_pipeline.lake.state import typed_state
from es_pipeline.lake.typed import event_tables


def lake_tables(warehouse: Location) -> list[str]:
    """The fixed tables (`tables.TABLES`, `events` first), then the typed state tables, the cross-stream
    projections and the typed event tables (with their mapping) there now (whatever the domain), and `_dead_letters`
    where there is one (last: a tenant's erasure deletes its rows once the tables they list no longer hold it)."""
    letters = [dead_letters.NAME] if tables.is_delta_table(dead_letters.DEAD_LETTERS.path(warehouse)) else []
    return [*tables.TABLES, *typed_state.table_names(warehouse), *cross_stream.table_names(warehouse),
            *event_tables.table_names(warehouse), *letters]


def turn_of(name: str) -> str:
    """The turn a table is written in: its own; a typed state table's is `stream_state`'s, a typed event table's
    the mapping's (`event_tables`)."""
    if name.startswith(typed_state.PREFIX):
        return "stream_state"
    return event_tables.NAME if name.startswith(event_tables.PREFIX) else name
