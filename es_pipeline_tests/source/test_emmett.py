"""An Emmett store, written by the real Emmett client (Node), adopted and extracted while it is written."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable

from es_pipeline.dev import emmett_client as emmett
from es_pipeline.errors import SourceNotServable
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.lake.delta import tables
from es_pipeline.source import mapping
from es_pipeline.store.adopt import adopt
from es_pipeline_tests.support.lakecheck import extract_while
from es_pipeline_tests.support.roles import StoreDsn

WORKERS, STREAMS, EVENTS = 8, 25, 80  # 16,000 events, a few seconds of appending


def _lake_rows(warehouse: Path) -> Counter[tuple[object, ...]]:
    t = DeltaTable(tables.table_path(warehouse, "events")).to_pyarrow_table().to_pylist()
    return Counter((r["tenant"], r["stream_id"], r["stream_type"], r["version"], r["global_position"],
                    r["event_type"], json.loads(r["payload"])["qty"], r["payload_encoding"]) for r in t)


def _store_rows(dsn: str) -> Counter[tuple[object, ...]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT partition, stream_id, split_part(stream_id, '-', 1), stream_position, global_position, "
            "message_type, (message_data->>'qty')::int, 'json' FROM emt_messages WHERE message_kind = 'E'"
        ).fetchall()
    return Counter(tuple(r) for r in rows)


def test_emmett_store_is_extracted_exactly_once_while_eight_node_writers_append(
    dsn: StoreDsn, emmett_app: str, warehouse: Path,
) -> None:
    """The lake equals emt_messages event by event, though adoption and every extraction ran while 8 Emmett
    clients appended (out-of-order commits, batches of 1-4 events), and Emmett still reads its streams."""
    assert emmett.finished(emmett.start_appending(emmett_app, "boot", 1, 3)) == 3  # Emmett creates its tables
    source = mapping.emmett()
    writers = [emmett.start_appending(emmett_app, str(w), STREAMS, EVENTS, per_append=1 + w % 4) for w in range(WORKERS)]
    adopted = adopt(dsn, source, echo=lambda _: None)  # the owner's (DBA's) login, while the writers append
    assert adopted.added == []  # Emmett has its transaction_id xid8 already
    assert len(adopted.indexes) == 2 * 4  # two indexes: on emt_messages, its default partition, and its 2 leaves

    extractor = Extractor(dsn.extractor, None, warehouse, source=source)  # es_pipeline's least-privilege login
    runs = extract_while(extractor, lambda: any(w.poll() is None for w in writers))
    appended = sum(emmett.finished(w) for w in writers)

    assert appended == WORKERS * STREAMS * EVENTS
    store, lake = _store_rows(dsn), _lake_rows(warehouse)
    assert sum(store.values()) == appended + 3
    assert max(lake.values()) == 1, "an event landed twice"
    assert lake == store
    assert runs >= 2, "the writers finished before a second extraction: the test saw no concurrency"

    # Emmett's own reads and writes go on as before adoption.
    assert emmett.read_stream(emmett_app, "cart-3-2")["count"] == EVENTS
    assert emmett.finished(emmett.start_appending(emmett_app, "after", 1, 5)) == 5
    assert not adopt(dsn, source, echo=lambda _: None).changed  # adopting twice changes nothing
    extractor.run(SliceRange(0, 1023), run_id="after")
    assert _lake_rows(warehouse) == _store_rows(dsn)


def test_adopt_refuses_a_table_without_the_columns_it_reads(dsn: StoreDsn) -> None:
    """A table that looks like Emmett's but lacks a column is refused, naming the column; nothing changes."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA half; CREATE TABLE half.emt_messages (stream_id text, stream_position bigint, "
                     "global_position bigint, transaction_id xid8, message_type text, message_data jsonb, "
                     "message_metadata jsonb, created timestamptz, partition text)")
    with pytest.raises(SourceNotServable, match="has no column message_kind"):
        adopt(dsn, mapping.emmett("half"), echo=lambda _: None)
    with pytest.raises(SourceNotServable, match="there is no table nowhere.emt_messages"):
        adopt(dsn, mapping.emmett("nowhere"), echo=lambda _: None)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pg_indexes WHERE schemaname = 'half'").fetchone() == (0,)


@pytest.mark.slow  # a cluster of its own and Node writers: in `make test`, not `make check`
def test_an_emmett_store_restored_before_adoption_is_extracted_whole(
    dsn: StoreDsn, emmett_app: str, warehouse: Path, tmp_path: Path,
) -> None:
    """Emmett's `transaction_id` keeps the old cluster's ids through a dump and restore: adopted and extracted on
    the new cluster for the first time, every message is in the lake once (the first run rebases by itself)."""
    from contextlib import ExitStack

    from es_pipeline_tests.support.cluster import another_cluster, dump, restore
    from es_pipeline_tests.support.roles import login_roles

    with psycopg.connect(dsn, autocommit=True) as conn:  # years of traffic on the old cluster
        for _ in range(3000):
            conn.execute("SELECT pg_current_xact_id()")
    assert emmett.finished(emmett.start_appending(emmett_app, "boot", 1, 3)) == 3  # Emmett creates its tables
    writers = [emmett.start_appending(emmett_app, f"old{w}", 10, 20, per_append=1 + w) for w in range(2)]
    assert sum(emmett.finished(w) for w in writers) == 400
    old = dump(dsn, tmp_path / "emmett.dump")
    with ExitStack() as stack:
        admin = stack.enter_context(another_cluster("emmett-restore"))
        db = restore(old, admin, "emmett_restored")
        store = StoreDsn.of(db, stack.enter_context(login_roles(admin)))
        # The application carries on there (as the cluster's owner: its own login stayed on the old cluster).
        assert emmett.finished(emmett.start_appending(store, "new", 5, 20, per_append=2)) == 100
        source = mapping.emmett()
        adopt(store, source, echo=lambda _: None)
        with psycopg.connect(store) as conn:
            row = conn.execute("SELECT count(*) FROM emt_messages WHERE "
                               "transaction_id >= pg_snapshot_xmax(pg_current_snapshot())").fetchone()
        assert row is not None and row[0] > 0, "the drill needs restored ids above the new cluster's counter"
        extractor = Extractor(store.extractor, None, warehouse, source=source)
        extractor.run(SliceRange(0, 1023))
        assert emmett.finished(emmett.start_appending(store, "after", 2, 10)) == 20
        extractor.run(SliceRange(0, 1023), run_id="after")
        store_rows, lake = _store_rows(store), _lake_rows(warehouse)
        assert sum(store_rows.values()) == 523
        assert max(lake.values()) == 1, "a message landed twice"
        assert lake == store_rows
