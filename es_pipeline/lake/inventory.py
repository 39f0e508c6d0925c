"""Every table es_pipeline keeps in a lake, and the turn (lake/serial.py) each is written in: what maintenance
compacts, the catalog registers and a tenant's erasure deletes from."""

from __future__ import annotations

from es_pipeline.lake import cross_stream, tables, typed_state
from es_pipeline.lake.tables import Location


def lake_tables(warehouse: Location) -> list[str]:
    """The fixed tables (`tables.TABLES`, `events` first), then the typed state tables and the cross-stream
    projections there now (whatever the domain)."""
    return [*tables.TABLES, *typed_state.table_names(warehouse), *cross_stream.table_names(warehouse)]


def turn_of(name: str) -> str:
    """The turn a table is written in: its own; a typed state table's is `stream_state`'s."""
    return "stream_state" if name.startswith(typed_state.PREFIX) else name
