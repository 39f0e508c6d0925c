"""Pekko Persistence JDBC, the real thing: two JVMs running a Pekko typed application (jdbc-journal on
PostgreSQL, Jackson JSON events) persist while es_pipeline adopts the journal and extracts it over and over;
afterwards Pekko still replays every event from the adopted journal."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psycopg
from deltalake import DeltaTable
from psycopg import sql

from es_pipeline.dev import pekko_client as pekko
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.lake.delta import tables
from es_pipeline.source import mapping
from es_pipeline.store import roles
from es_pipeline.store.adopt import adopt
from es_pipeline_tests.source.test_presets import PEKKO_JDBC_DDL, lake_keys, source_rows
from es_pipeline_tests.support.lakecheck import extract_while
from es_pipeline_tests.support.roles import StoreDsn

WORKERS, ENTITIES, EVENTS, PAUSE_MS = 2, 20, 30, 150  # 1,200 events over about 5 s per JVM


def _words(text: str) -> str:
    return " ".join(text.split())


def _journal_rows(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM public.event_journal").fetchone()
    return int(row[0]) if row else 0


def test_pekko_jdbc_application_writes_while_its_journal_is_adopted_and_extracted(
    dsn: StoreDsn, warehouse: Path,
) -> None:
    """The lake equals event_journal event by event, each once, though adoption and every extraction ran while
    two Pekko JVMs persisted (batched inserts on several connections, out-of-order commits); the payloads are
    Pekko's Jackson JSON; Pekko replays all the events from the journal es_pipeline adopted."""
    pekko.install()  # the first time, Maven builds it (outside the timing below)
    script = _words(pekko.published_schema())
    for statement in filter(str.strip, PEKKO_JDBC_DDL.split(";")):
        assert _words(statement) in script, "PEKKO_JDBC_DDL is no longer the plugin's own event_journal DDL"
    writer = sql.Identifier(dsn.logins[roles.WRITER])
    with psycopg.connect(dsn, autocommit=True) as conn:  # the DBA: the journal, and what the application may do
        conn.execute(PEKKO_JDBC_DDL)  # type: ignore[arg-type]
        conn.execute(sql.SQL("GRANT SELECT, INSERT ON public.event_journal TO {}").format(writer))
        conn.execute(sql.SQL("GRANT USAGE ON SEQUENCE public.event_journal_ordering_seq TO {}").format(writer))

    source = mapping.pekko_jdbc()
    writers = [pekko.start(dsn.writer, "write", str(w), ENTITIES, EVENTS, PAUSE_MS) for w in range(WORKERS)]
    deadline = time.monotonic() + 120
    while _journal_rows(dsn) == 0:  # adopt once Pekko is writing, not before its JVMs are up
        assert time.monotonic() < deadline, "no Pekko writer wrote within 120 s"
        for w in writers:
            if w.poll() is not None:
                pekko.finished(w)  # raises with the writer's error output
        time.sleep(0.1)
    adopted = adopt(dsn, source, echo=lambda _: None)  # the owner's (DBA's) login, while Pekko writes
    assert adopted.added == ["tx_id"]
    assert len(adopted.indexes) == 2

    extractor = Extractor(dsn.extractor, None, warehouse, source=source)  # es_pipeline's least-privilege login
    runs = extract_while(extractor, lambda: any(w.poll() is None for w in writers))
    written = sum(pekko.finished(w) for w in writers)

    assert written == WORKERS * ENTITIES * EVENTS
    rows = DeltaTable(tables.table_path(warehouse, "events")).to_pyarrow_table().to_pylist()
    lake, store = lake_keys(rows), source_rows(dsn, source)
    assert sum(store.values()) == written
    assert max(lake.values()) == 1, "an event landed twice"
    assert lake == store
    assert runs >= 2, "the writers finished before a second extraction: the test saw no concurrency"
    assert {(r["stream_type"], r["event_type"], r["payload_encoding"]) for r in rows} == {
        ("cart", "espipeline.pekko.Writer$ItemAdded", "json")}
    for r in rows:  # Pekko's Jackson JSON as stored; a cart's n-th command was its n-th event
        assert json.loads(str(r["payload"]))["qty"] == r["version"]
        assert json.loads(str(r["metadata"]))["ser_manifest"] == "espipeline.pekko.Writer$ItemAdded"
    assert {str(r["stream_id"]) for r in rows} == {f"cart|{w}-{i}" for w in range(WORKERS) for i in range(ENTITIES)}

    # Pekko still reads its journal (with tx_id and es_pipeline's indexes) and replays every event.
    readers = [pekko.start(dsn.writer, "read", str(w), ENTITIES) for w in range(WORKERS)]
    assert [pekko.finished(r) for r in readers] == [ENTITIES * EVENTS] * WORKERS
    assert not adopt(dsn, source, echo=lambda _: None).changed  # adopting twice changes nothing
