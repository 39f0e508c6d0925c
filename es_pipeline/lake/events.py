"""`events`: one row per event of the store, the table every other one is built from, defined once as a `Table`.

Its columns: what the source reads (`READ_SCHEMA`, extraction/reader.py), then the lake's own (`event_date`,
`batch_id`), then the two that source mappings added, where a table of an older release takes them
(`tables.add_missing_columns`). Written by the extractor (extraction/extractor.py) under the app id of each
range, one Delta transaction per batch, never by the projections.
"""

from __future__ import annotations

import pyarrow as pa
from deltalake import DeltaTable

from es_pipeline.lake.delta.definition import Table
from es_pipeline.lake.delta.tables import UTC_MICROS

_READ_FIRST = [
    ("global_position", pa.int64()), ("tx_id", pa.int64()), ("stream_id", pa.string()), ("stream_type", pa.string()),
    ("version", pa.int32()), ("slice", pa.int32()), ("event_type", pa.string()), ("payload", pa.string()),
    ("metadata", pa.string()), ("recorded_at", UTC_MICROS),
]
_LAKE_ADDED = [("event_date", pa.date32()), ("batch_id", pa.int64())]
# Added with source mappings (docs/sources.md): at the end, where a lake table of an older release takes them.
_READ_LAST = [("payload_encoding", pa.string()),  # json, text or base64
              ("tenant", pa.string())]  # '' in a store without tenants

READ_SCHEMA = pa.schema([*_READ_FIRST, *_READ_LAST])  # a batch as the source reads it

STATS_COLUMNS = "tx_id,slice,stream_id,version,global_position,event_date,recorded_at"

EVENTS = Table(
    "events", pa.schema([*_READ_FIRST, *_LAKE_ADDED, *_READ_LAST]), key=("tenant", "stream_id", "version"),
    comment="one row per event",
    # Delta computes min/max statistics per file for the columns named here only: the ones queries prune on.
    # Statistics on the long JSON text columns cost ~40% of a write and prune nothing. The change data feed lets
    # every projection read only the rows that later commits added.
    # recorded_at's give each commit its oldest event's time, from which the health exporter reads commit→lake
    # latency without reading a row (lake/read/behind.py); and an analyst's time range prunes files on it.
    properties={"delta.dataSkippingStatsColumns": STATS_COLUMNS, "delta.enableChangeDataFeed": "true"},
)


def with_statistics(path: str) -> bool:
    """Give a table made by an older release (without `recorded_at` among its statistics columns) today's list:
    one metadata commit, no file rewritten; statistics of files written after. Whether it changed anything."""
    table = DeltaTable(path)
    named = table.metadata().configuration.get("delta.dataSkippingStatsColumns")
    if named is None or "recorded_at" in [c.strip() for c in named.split(",")]:
        return False
    try:
        table.alter.set_table_properties({"delta.dataSkippingStatsColumns": STATS_COLUMNS}, raise_if_not_exists=False)
    except Exception:  # noqa: BLE001 - a concurrent run changed it first; anything else re-raises
        if "recorded_at" not in DeltaTable(path).metadata().configuration.get("delta.dataSkippingStatsColumns", ""):
            raise
    return True
