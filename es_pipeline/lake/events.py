"""`events`: one row per event of the store, the table every other one is built from, defined once as a `Table`.

Its columns: what the source reads (`READ_SCHEMA`, extraction/reader.py), then the lake's own (`event_date`,
`batch_id`), then the two that source mappings added, where a table of an older release takes them
(`tables.add_missing_columns`). Written by the extractor (extraction/extractor.py) under the app id of each
range, one Delta transaction per batch, never by the projections.
"""

from __future__ import annotations

import pyarrow as pa

from es_pipeline.lake.table import Table

_READ_FIRST = [
    ("global_position", pa.int64()), ("tx_id", pa.int64()), ("stream_id", pa.string()), ("stream_type", pa.string()),
    ("version", pa.int32()), ("slice", pa.int32()), ("event_type", pa.string()), ("payload", pa.string()),
    ("metadata", pa.string()), ("recorded_at", pa.timestamp("us", tz="UTC")),
]
_LAKE_ADDED = [("event_date", pa.date32()), ("batch_id", pa.int64())]
# Added with source mappings (docs/sources.md): at the end, where a lake table of an older release takes them.
_READ_LAST = [("payload_encoding", pa.string()),  # json, text or base64
              ("tenant", pa.string())]  # '' in a store without tenants

READ_SCHEMA = pa.schema([*_READ_FIRST, *_READ_LAST])  # a batch as the source reads it

EVENTS = Table(
    "events", pa.schema([*_READ_FIRST, *_LAKE_ADDED, *_READ_LAST]), key=("tenant", "stream_id", "version"),
    comment="one row per event",
    # Delta computes min/max statistics per file for the columns named here only: the ones queries prune on.
    # Statistics on the long JSON text columns cost ~40% of a write and prune nothing. The change data feed lets
    # every projection read only the rows that later commits added.
    properties={"delta.dataSkippingStatsColumns": "tx_id,slice,stream_id,version,global_position,event_date",
                "delta.enableChangeDataFeed": "true"},
)
