"""Payloads stored as bytes: JSON where they are UTF-8 JSON, base64 otherwise; what reducers are given (pure)."""

from __future__ import annotations

import base64
import gzip
import json

import pyarrow as pa
import pytest

from es_pipeline.source import payloads


@pytest.mark.parametrize("raw, encoding", [
    (b'{"n": 1, "s": "\xc3\xbc"}', "json"),  # Jackson JSON, UTF-8
    (b"[1, 2]", "json"),
    (gzip.compress(b'{"n": 1}', mtime=0), "base64"),  # Jackson gzips large payloads
    (b"\xbf\x61\x6e\x01\xff", "base64"),  # CBOR
    (b"\xff\xfe", "base64"),  # not UTF-8
    (b"not json", "base64"),  # UTF-8, not JSON
])
def test_bytes_land_as_json_or_as_base64_of_the_exact_bytes(raw: bytes, encoding: str) -> None:
    text, got = payloads.decode(raw)
    assert got == encoding
    assert text is not None
    assert (text.encode() if got == "json" else base64.b64decode(text)) == raw


def test_a_record_batch_is_decoded_in_place() -> None:
    batch = pa.RecordBatch.from_pydict({"payload": pa.array([b'{"a":1}', b"\x00"], pa.binary()),
                                        "payload_encoding": pa.array([None, None], pa.string())})
    out = payloads.decode_column(batch)
    assert out.schema.field("payload").type == pa.string()
    assert out.to_pydict() == {"payload": ['{"a":1}', "AA=="], "payload_encoding": ["json", "base64"]}


def test_reducers_get_json_as_is_and_other_payloads_wrapped_by_their_encoding() -> None:
    table = pa.table({"payload": ['{"a":1}', "AA==", "plain", '{"b":2}'],
                      "payload_encoding": ["json", "base64", "text", None]})
    out = payloads.for_reducers(table)
    assert out.column_names == ["payload"]
    assert [json.loads(p) for p in out["payload"].to_pylist()] == [{"a": 1}, {"base64": "AA=="}, {"text": "plain"},
                                                                   {"b": 2}]
