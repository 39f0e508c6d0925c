"""A run that dies mid-batch on an adopted framework's table: the next run replays that batch, and every event
lands once, binary payloads decoded the same way (the pending batch is re-read by its bounds)."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable

from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange, split
from es_pipeline.lake.delta import tables
from es_pipeline.source import mapping
from es_pipeline.store.adopt import adopt
from es_pipeline_tests.source.test_presets import (
    EVENTS_EACH,
    PEKKO_R2DBC_DDL,
    STREAMS_EACH,
    WRITERS,
    lake_keys,
    r2dbc,
    source_rows,
    write_concurrently,
)
from es_pipeline_tests.support.hooks import Crash, crash_at
from es_pipeline_tests.support.roles import StoreDsn


@pytest.mark.parametrize("step", ["read", "delta_committed"])
def test_a_run_killed_mid_batch_on_an_adopted_journal_is_replayed_once(dsn: StoreDsn, warehouse: Path, step: str) -> None:
    source = mapping.pekko_r2dbc()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(PEKKO_R2DBC_DDL)  # type: ignore[arg-type]
    adopt(dsn, source, echo=lambda _: None)
    threads = write_concurrently(dsn, r2dbc, threading.Event())
    for t in threads:
        t.join()
    ranges = split(2)
    with pytest.raises(Crash):
        Extractor(dsn.extractor, None, warehouse, source=source, on_step=crash_at(step)).run(ranges[0])
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM es_pipeline.pending_batches").fetchone() == (1,)
    again = Extractor(dsn.extractor, None, warehouse, source=source)
    assert again.run(ranges[0]).replayed_batches == 1
    again.run(ranges[1])
    again.run(SliceRange(0, 1023))  # re-sliced: nothing left, nothing twice
    rows = DeltaTable(tables.table_path(warehouse, "events")).to_pyarrow_table().to_pylist()
    assert len(rows) == WRITERS * STREAMS_EACH * EVENTS_EACH
    assert lake_keys(rows) == source_rows(dsn, source)
    assert Counter(r["payload_encoding"] for r in rows).keys() == {"json", "base64"}
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM es_pipeline.pending_batches").fetchone() == (0,)
