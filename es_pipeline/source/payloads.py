"""Payloads that arrive as bytes (Pekko's `event_payload bytea`): JSON where they are UTF-8 JSON, else base64.

Nothing is lost either way: `payload_encoding` says which, and base64 decodes to the exact bytes. A
payload compressed by its serializer (Jackson gzips above a size) is not JSON as stored: it lands as base64.
"""

from __future__ import annotations

import base64
import json

import pyarrow as pa

JSON, BASE64 = "json", "base64"


def decode(raw: bytes | None) -> tuple[str | None, str | None]:
    """(payload text, encoding) of one stored payload."""
    if raw is None:
        return None, None
    try:
        text = raw.decode("utf-8")
        json.loads(text)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError both are
        return base64.b64encode(raw).decode("ascii"), BASE64
    return text, JSON


def decode_column(batch: pa.RecordBatch) -> pa.RecordBatch:
    """`batch` with its binary `payload` column decoded, and `payload_encoding` filled in."""
    names = batch.schema.names
    pairs = [decode(v) for v in batch.column(names.index("payload")).to_pylist()]
    columns = list(batch.columns)
    columns[names.index("payload")] = pa.array([p for p, _ in pairs], pa.string())
    columns[names.index("payload_encoding")] = pa.array([e for _, e in pairs], pa.string())
    fields = [pa.field(n, pa.string()) if n in ("payload", "payload_encoding") else batch.schema.field(n)
              for n in names]
    return pa.RecordBatch.from_arrays(columns, schema=pa.schema(fields))


# What a reducer is given for a payload that is not JSON: a JSON object naming its encoding, so that it
# can still fold such events (decode `base64` itself) instead of failing on unparseable JSON.
def wrapped(payload: str, encoding: str | None) -> str:
    """The payload as a reducer reads it: JSON as is; base64 or text as `{"base64": …}` / `{"text": …}`."""
    if encoding in (None, JSON):
        return payload
    return json.dumps({encoding: payload})


def for_reducers(table: pa.Table) -> pa.Table:
    """`table` with its payloads as reducers read them (`wrapped`), and no `payload_encoding` column."""
    if "payload_encoding" not in table.column_names:
        return table
    encodings = table["payload_encoding"]
    if encodings.null_count == len(encodings) or all(e in (None, JSON) for e in encodings.unique().to_pylist()):
        return table.drop_columns(["payload_encoding"])
    payloads = [wrapped(p, e) for p, e in zip(table["payload"].to_pylist(), encodings.to_pylist(), strict=True)]
    i = table.column_names.index("payload")
    return table.set_column(i, "payload", pa.array(payloads, pa.string())).drop_columns(["payload_encoding"])
