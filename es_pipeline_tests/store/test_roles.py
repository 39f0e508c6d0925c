"""The role model (`es-pipeline db roles`): each role can do its part and nothing more, and the whole
extraction path — runs, status, the sensor's probe, the checks — works as the extractor role."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest

from es_pipeline.extraction import offsets, reader
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.probe import probe
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.extraction.status import status_report
from es_pipeline.settings import Settings
from es_pipeline.store import roles
from es_pipeline.store.event_store import EventStore, NewEvent, Snapshot
from es_pipeline.store.migrations import migrate
from es_pipeline_tests.support.lakecheck import source_events
from es_pipeline_tests.support.roles import StoreDsn


@pytest.fixture
def role_dsns(dsn: StoreDsn) -> dict[str, str]:
    """The role model applied once more (every test database has it), and a DSN per group role's login."""
    printed: list[str] = []
    roles.apply(dsn, "es", echo=printed.append)
    assert roles.apply(dsn, "es", echo=lambda _: None) == len(printed), "applying again is the same, and works"
    assert any("GRANT INSERT (" in p for p in printed)
    return {roles.WRITER: dsn.writer, roles.EXTRACTOR: dsn.extractor, roles.SNAPSHOTS: dsn.snapshots}


def _denied(dsn: str, statement: str) -> bool:
    with psycopg.connect(dsn) as conn:
        try:
            conn.execute(statement)
        except psycopg.errors.InsufficientPrivilege:
            return True
    return False


def test_each_role_does_its_part_and_no_more(dsn: str, role_dsns: dict[str, str], tmp_path: Path) -> None:
    writer, extractor, snapshots = role_dsns[roles.WRITER], role_dsns[roles.EXTRACTOR], role_dsns[roles.SNAPSHOTS]
    store = EventStore(writer)
    for i in range(20):
        store.append(f"acct-{i}", "account", [NewEvent("Opened", {"i": i}), NewEvent("Deposited", {"n": i})], 0)
    assert _denied(writer, "INSERT INTO es.events (tx_id, stream_id, stream_type, version, event_type, payload) "
                           "VALUES (pg_current_xact_id(), 'x', 't', 1, 'E', '{}')"), "a writer cannot set tx_id"
    assert _denied(writer, "DELETE FROM es.events"), "a writer cannot delete events"
    assert _denied(writer, "SELECT * FROM es_pipeline.offsets"), "a writer cannot touch es_pipeline's tables"

    # Extraction, status, the probe and the checks' queries, all as the extractor.
    assert migrate(extractor) == [], "an up-to-date store needs no CREATE from the extractor"
    warehouse = tmp_path / "warehouse"
    extracted = Extractor(extractor, None, warehouse).run(SliceRange(0, 1023))
    assert extracted.rows == 40
    settings = Settings.from_env({"ES_PIPELINE_PG_DSN": extractor, "ES_PIPELINE_SLICE_RANGES": "2"})
    assert "0512-1023" in status_report(settings)
    with psycopg.connect(extractor) as conn:
        found = probe(conn, "es", offsets.EVENTS_CONSUMER)  # everything extracted: nothing ready
        assert found.ready_slices == frozenset() and found.horizon >= extracted.horizon
        assert sum(offsets.counts_below_watermarks(conn, "es", offsets.EVENTS_CONSUMER).values()) == 40
    assert len(source_events(extractor)) == 40
    assert _denied(extractor, "INSERT INTO es.events (stream_id, stream_type, version, event_type, payload) "
                              "VALUES ('x', 't', 1, 'E', '{}')"), "the extractor cannot write the store"
    assert _denied(extractor, "INSERT INTO es.snapshots (stream_id, stream_type, version, state, revision) "
                              "VALUES ('x', 't', 1, '{}', 1)")
    # es_pipeline's tables that others read as the truth: read, never written, by the extractor.
    assert _denied(extractor, "INSERT INTO es_pipeline.snapshots (consumer, stream_id, stream_type, version, state, "
                              "revision) VALUES ('events', 'x', 't', 1, '{}', 1)"), "the write-back's table"
    assert _denied(extractor, "UPDATE es_pipeline.snapshots SET revision = 2"), "the write-back's table"
    assert _denied(extractor, "UPDATE es_pipeline.tenant_erasures SET finished_at = now()"), "the erasure record"
    assert _denied(extractor, "DELETE FROM es_pipeline.tenant_erasures"), "the erasure record"
    with psycopg.connect(extractor) as conn:
        conn.execute("SELECT count(*) FROM es_pipeline.snapshots, es_pipeline.tenant_erasures").fetchone()

    # The lag figure sees a writer's open transaction (pg_read_all_stats), as a superuser would.
    opened, release = threading.Event(), threading.Event()

    def hold() -> None:
        with psycopg.connect(writer) as conn:
            conn.execute("SELECT pg_current_xact_id()")
            opened.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        opened.wait(10)
        time.sleep(1.2)
        with psycopg.connect(extractor) as conn:
            assert reader.oldest_open_transaction_seconds(conn) >= 1.0
    finally:
        release.set()
        holder.join()

    # The snapshot write-back: snapshots, and nothing else.
    EventStore(snapshots).write_snapshots([Snapshot("acct-1", "account", 2, {"balance": 1}, 1)])
    assert _denied(snapshots, "SELECT count(*) FROM es.events")
    assert _denied(snapshots, "SELECT count(*) FROM es_pipeline.offsets")
