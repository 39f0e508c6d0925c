"""extraction/reader.py against a real store: a batch's rows, read by one query or dealt over several, are exactly
the events between each slice's lower bound and the upper bound; a value past the lake's type is refused; a
consumer that stops early stops the reading threads."""

from __future__ import annotations

import threading
import time

import psycopg
import pyarrow as pa
import pytest

from es_pipeline.errors import SourceNotServable
from es_pipeline.extraction import reader
from es_pipeline.extraction.offsets import Batch
from es_pipeline.lake.events import READ_SCHEMA
from es_pipeline.source import mapping
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.roles import StoreDsn


def _store_rows(dsn: str) -> list[tuple[int, str, int, int]]:
    """(slice, stream, version, tx_id) of every event."""
    with psycopg.connect(dsn) as conn:
        return [(int(s), sid, int(v), int(tx)) for s, sid, v, tx in conn.execute(
            "SELECT slice, stream_id, version, tx_id::text::bigint FROM es.events").fetchall()]


def _read(dsn: str, batch: Batch, parallel: int) -> set[tuple[int, str, int, int]]:
    table = pa.Table.from_batches(list(reader.stream_batch(dsn, "es", batch, parallel=parallel)), schema=READ_SCHEMA)
    return set(zip(table["slice"].to_pylist(), table["stream_id"].to_pylist(), table["version"].to_pylist(),
                   table["tx_id"].to_pylist(), strict=True))


def _fill(dsn: StoreDsn, streams: int = 40) -> list[tuple[int, str, int, int]]:
    store = EventStore(dsn)
    for i in range(streams):  # a transaction per stream: many tx ids, streams over many slices
        store.append(f"acc-{i}", "account", [NewEvent("Opened", {"owner": f"o{i}"}), NewEvent("Deposited", {"amount": i})], 0)
    return _store_rows(dsn)


def test_a_batch_is_every_event_between_each_slices_bounds_whether_read_by_one_query_or_several(dsn: StoreDsn) -> None:
    rows = _fill(dsn)
    slices = sorted({r[0] for r in rows})
    txs = sorted({r[3] for r in rows})
    low, high = txs[len(txs) // 4], txs[3 * len(txs) // 4]
    # Per-slice lower bounds that differ (the LATERAL form): the first half of the slices from `low`, the rest from 0.
    bounds = tuple(low if i % 2 == 0 else 0 for i in range(len(slices)))
    batch = Batch("events", "app", tuple(slices), bounds, high)
    expected = {r for r in rows if bounds[slices.index(r[0])] <= r[3] < high}
    assert 0 < len(expected) < len(rows)
    assert _read(dsn, batch, 1) == expected
    assert _read(dsn, batch, 3) == expected  # dealt over three connections: the same rows, none twice
    with psycopg.connect(dsn) as conn:
        assert reader.count_between(conn, "es", batch.bounds, high) == len(expected)
        assert reader.first_tx_ids(conn, "es", batch.bounds, high) == min(r[3] for r in expected)
    # One shared lower bound (the steady state's `slice = ANY(...)` form).
    same = Batch("events", "app", tuple(slices), (low,) * len(slices), high)
    assert _read(dsn, same, 2) == {r for r in rows if low <= r[3] < high}
    # A slice whose lower bound is at the upper one has nothing to read and no query.
    assert Batch("events", "app", (1, 2), (high, 0), high).bounds == [(2, 0)]


def test_a_value_past_the_lakes_type_is_refused_by_name_never_wrapped() -> None:
    columns = {f.name: pa.nulls(1, f.type) for f in READ_SCHEMA}
    columns["version"] = pa.array([2**31], pa.int64())
    batch = pa.RecordBatch.from_pydict(columns)
    with pytest.raises(SourceNotServable, match="does not fit the lake's column"):
        reader.conform(mapping.native("es"), batch)


def test_a_consumer_that_stops_early_stops_the_reading_threads(dsn: StoreDsn) -> None:
    rows = _fill(dsn, streams=60)
    slices = sorted({r[0] for r in rows})
    batch = Batch("events", "app", tuple(slices), (0,) * len(slices), max(r[3] for r in rows) + 1)
    stream = reader.stream_batch(dsn, "es", batch, parallel=3)
    assert next(stream).num_rows > 0
    stream.close()  # the consumer gives up after one record batch
    deadline = time.monotonic() + 10
    while any(t.name == "es-read" and t.is_alive() for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a reading thread outlived its consumer"
        time.sleep(0.05)
