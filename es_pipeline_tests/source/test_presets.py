"""Pekko (R2DBC, JDBC), Marten and a hand-rolled tenant-partitioned table: each built from its published DDL,
written concurrently with its framework's insert shape (out-of-order commits, rollbacks), adopted while written,
and extracted over and over; the lake must equal the table event by event."""

from __future__ import annotations

import base64
import gzip
import json
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable

from es_pipeline.errors import SourceNotServable
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.lake.delta import tables
from es_pipeline.source import mapping
from es_pipeline.source.mapping import Source
from es_pipeline.store.adopt import adopt
from es_pipeline_tests.support.lakecheck import extract_while
from es_pipeline_tests.support.roles import StoreDsn

WRITERS, STREAMS_EACH, EVENTS_EACH = 6, 5, 40

# ddl-scripts/create_tables_postgres.sql of apache/pekko-persistence-r2dbc (event_journal, as published)
PEKKO_R2DBC_DDL = """
CREATE TABLE IF NOT EXISTS event_journal(
  slice INT NOT NULL,
  entity_type VARCHAR(255) NOT NULL,
  persistence_id VARCHAR(255) NOT NULL,
  seq_nr BIGINT NOT NULL,
  db_timestamp timestamp with time zone NOT NULL,
  event_ser_id INTEGER NOT NULL,
  event_ser_manifest VARCHAR(255) NOT NULL,
  event_payload BYTEA NOT NULL,
  deleted BOOLEAN DEFAULT FALSE NOT NULL,
  writer VARCHAR(255) NOT NULL,
  adapter_manifest VARCHAR(255),
  tags TEXT ARRAY,
  meta_ser_id INTEGER,
  meta_ser_manifest VARCHAR(255),
  meta_payload BYTEA,
  PRIMARY KEY(persistence_id, seq_nr)
);
CREATE INDEX IF NOT EXISTS event_journal_slice_idx ON event_journal(slice, entity_type, db_timestamp, seq_nr);
"""

# core/src/main/resources/schema/postgres/postgres-create-schema.sql of apache/pekko-persistence-jdbc 1.1.x
PEKKO_JDBC_DDL = """
CREATE TABLE IF NOT EXISTS public.event_journal(
  ordering BIGSERIAL,
  persistence_id VARCHAR(255) NOT NULL,
  sequence_number BIGINT NOT NULL,
  deleted BOOLEAN DEFAULT FALSE NOT NULL,
  writer VARCHAR(255) NOT NULL,
  write_timestamp BIGINT,
  adapter_manifest VARCHAR(255),
  event_ser_id INTEGER NOT NULL,
  event_ser_manifest VARCHAR(255) NOT NULL,
  event_payload BYTEA NOT NULL,
  meta_ser_id INTEGER,
  meta_ser_manifest VARCHAR(255),
  meta_payload BYTEA,
  PRIMARY KEY(persistence_id, sequence_number)
);
CREATE UNIQUE INDEX event_journal_ordering_idx ON public.event_journal(ordering);
"""

# Marten's mt_streams / mt_events (TenancyStyle.Conjoined, Guid stream identity), as Weasel writes them.
MARTEN_DDL = """
CREATE TABLE IF NOT EXISTS public.mt_streams (
    tenant_id      varchar        NOT NULL DEFAULT '*DEFAULT*',
    id             uuid           NOT NULL,
    type           varchar        NULL,
    version        bigint         NULL,
    timestamp      timestamptz    NOT NULL DEFAULT (now()),
    created        timestamptz    NOT NULL DEFAULT (now()),
    is_archived    bool           NULL DEFAULT FALSE,
CONSTRAINT pkey_mt_streams_tenant_id_id PRIMARY KEY (tenant_id, id)
);
CREATE TABLE IF NOT EXISTS public.mt_events (
    seq_id            bigint                      NOT NULL,
    id                uuid                        NOT NULL,
    stream_id         uuid                        NULL,
    version           bigint                      NOT NULL,
    data              jsonb                       NOT NULL,
    bdata             bytea                       NULL,
    type              varchar(500)                NOT NULL,
    timestamp         timestamp with time zone    NOT NULL DEFAULT '(now())',
    tenant_id         varchar                     NULL DEFAULT '*DEFAULT*',
    mt_dotnet_type    varchar                     NULL,
    is_archived       bool                        NULL DEFAULT FALSE,
CONSTRAINT pkey_mt_events_seq_id PRIMARY KEY (seq_id)
);
ALTER TABLE public.mt_events ADD CONSTRAINT fkey_mt_events_stream_id_tenant_id FOREIGN KEY(tenant_id, stream_id)
REFERENCES public.mt_streams(tenant_id, id);
CREATE UNIQUE INDEX pk_mt_events_stream_and_version ON public.mt_events USING btree (tenant_id, stream_id, version);
CREATE SEQUENCE public.mt_events_sequence;
ALTER SEQUENCE public.mt_events_sequence OWNED BY public.mt_events.seq_id;
"""

# The original design notes' hand-rolled table, one partition per tenant.
SEED_DDL = """
CREATE SCHEMA app;
CREATE TABLE app."Event" (
    "SequenceNum" bigint GENERATED ALWAYS AS IDENTITY,
    "TenantId" text NOT NULL,
    "StreamId" text NOT NULL,
    "Version" int NOT NULL,
    "Type" text NOT NULL,
    "Meta" jsonb NOT NULL DEFAULT '{}',
    "Data" jsonb NOT NULL,
    "LogDate" timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY ("TenantId", "StreamId", "Version")
) PARTITION BY LIST ("TenantId");
CREATE TABLE app."Event_acme" PARTITION OF app."Event" FOR VALUES IN ('acme');
CREATE TABLE app."Event_globex" PARTITION OF app."Event" FOR VALUES IN ('globex');
CREATE TABLE app."Event_initech" PARTITION OF app."Event" FOR VALUES IN ('initech');
"""
SEED_TOML = """
[source]
table = 'app.Event'  # names as they are (case kept), not quoted
stream_id = '"StreamId"'
stream_type = "split_part(\\"StreamId\\", '-', 1)"
version = '"Version"'
event_type = '"Type"'
payload = '"Data"'
metadata = '"Meta"'
recorded_at = '"LogDate"'
global_position = '"SequenceNum"'
tenant = '"TenantId"'
columns = ["SequenceNum", "TenantId", "StreamId", "Version", "Type", "Meta", "Data", "LogDate"]
"""

Append = Callable[[psycopg.Connection, str, str, int, random.Random], None]  # (conn, writer, stream, version, rng)


def _jackson_or_binary(rng: random.Random, n: int) -> bytes:
    """What Pekko's serializers store: Jackson JSON (UTF-8) mostly, gzipped JSON or CBOR-like bytes otherwise."""
    body = json.dumps({"n": n, "note": "ünïcode"}).encode()
    return body if n % 3 else (gzip.compress(body) if n % 2 else bytes([0xBF, 0x61, 0x6E, n % 256, 0xFF]))


def r2dbc(conn: psycopg.Connection, writer: str, stream: str, v: int, rng: random.Random) -> None:
    pid = f"Cart|{stream}"
    conn.execute(
        "INSERT INTO event_journal (slice, entity_type, persistence_id, seq_nr, writer, adapter_manifest, event_ser_id, "
        "event_ser_manifest, event_payload, tags, meta_ser_id, meta_ser_manifest, meta_payload, db_timestamp) "
        "VALUES (%s, 'Cart', %s, %s, %s, '', 33, 'ItemAdded', %s, %s, NULL, NULL, NULL, transaction_timestamp())",
        (rng.randrange(1024), pid, v, writer, _jackson_or_binary(rng, v), ["cart"] if v % 2 else None),
    )


def _jdbc(conn: psycopg.Connection, writer: str, stream: str, v: int, rng: random.Random) -> None:
    conn.execute(
        "INSERT INTO event_journal (deleted, persistence_id, sequence_number, writer, write_timestamp, adapter_manifest, "
        "event_payload, event_ser_id, event_ser_manifest, meta_payload, meta_ser_id, meta_ser_manifest) "
        "VALUES (false, %s, %s, %s, %s, '', %s, 33, 'ItemAdded', NULL, NULL, NULL)",
        (f"Cart|{stream}", v, writer, int(time.time() * 1000), _jackson_or_binary(rng, v)),
    )


def _marten(conn: psycopg.Connection, writer: str, stream: str, v: int, rng: random.Random) -> None:
    tenant = "*DEFAULT*" if hash(stream) % 2 else "tenant-b"
    sid = uuid.uuid5(uuid.NAMESPACE_URL, stream)
    if v == 1:
        conn.execute("INSERT INTO mt_streams (id, type, version, timestamp, tenant_id) VALUES (%s, 'cart', 0, now(), %s)",
                     (sid, tenant))
    conn.execute(
        "INSERT INTO mt_events (seq_id, id, stream_id, version, data, bdata, type, tenant_id, timestamp, mt_dotnet_type, "
        "is_archived) VALUES (nextval('mt_events_sequence'), %s, %s, %s, %s, NULL, 'item_added', %s, now(), "
        "'Shop.ItemAdded, Shop', FALSE)",
        (uuid.uuid4(), sid, v, json.dumps({"n": v}), tenant),
    )


def _seed(conn: psycopg.Connection, writer: str, stream: str, v: int, rng: random.Random) -> None:
    tenant = ("acme", "globex", "initech")[int(stream.rsplit("-", 1)[-1]) % 3]
    conn.execute('INSERT INTO app."Event" ("TenantId", "StreamId", "Version", "Type", "Data") VALUES (%s, %s, %s, %s, %s)',
                 (tenant, stream, v, "ItemAdded", json.dumps({"n": v})))


def write_concurrently(dsn: str, append: Append, stop_after: threading.Event) -> list[threading.Thread]:
    """WRITERS threads, each appending to its own streams; transactions held open a random while (commits land
    out of order) and one in five rolled back (then retried)."""

    def writer(w: int) -> None:
        rng = random.Random(w)
        with psycopg.connect(dsn) as conn:
            for s in range(STREAMS_EACH):
                stream = f"cart-{w}-{s}"
                v = 1
                while v <= EVENTS_EACH:
                    n = rng.randint(1, 3)
                    for k in range(min(n, EVENTS_EACH - v + 1)):
                        append(conn, f"w{w}", stream, v + k, rng)
                    time.sleep(rng.random() * 0.02)
                    if rng.random() < 0.2:
                        conn.rollback()
                        continue
                    conn.commit()
                    v += min(n, EVENTS_EACH - v + 1)
        stop_after.set()

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
    for t in threads:
        t.start()
    return threads


def lands_once(dsn: StoreDsn, ddl: str, source: Source, append: Append, warehouse: Path) -> list[dict[str, object]]:
    """The table made by `ddl`, written concurrently by `append`, adopted and extracted while written: the lake's
    rows, once they were checked to be the table's events (through the mapping), each once."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ddl)  # type: ignore[arg-type]
    first = threading.Event()
    threads = write_concurrently(dsn, append, first)
    adopted = adopt(dsn, source, echo=lambda _: None)  # while the writers append
    assert adopted.indexes
    extractor = Extractor(dsn.extractor, None, warehouse, source=source)
    runs = extract_while(extractor, lambda: any(t.is_alive() for t in threads))
    for t in threads:
        t.join()
    assert runs >= 2, "the writers finished before a second extraction: the test saw no concurrency"
    assert not adopt(dsn, source, echo=lambda _: None).changed  # adopting twice changes nothing
    rows = DeltaTable(tables.table_path(warehouse, "events")).to_pyarrow_table().to_pylist()
    assert len(rows) == WRITERS * STREAMS_EACH * EVENTS_EACH
    assert lake_keys(rows) == source_rows(dsn, source)
    return rows


def source_rows(dsn: str, source: Source) -> Counter[tuple[object, ...]]:
    """The events as the mapping reads them straight from the table: what the lake must hold."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(f"SELECT tenant, stream_id, version, event_type, global_position FROM {source.relation()} e")
        return Counter(tuple(r) for r in rows.fetchall())


def lake_keys(rows: list[dict[str, object]]) -> Counter[tuple[object, ...]]:
    return Counter((r["tenant"], r["stream_id"], r["version"], r["event_type"], r["global_position"]) for r in rows)


def test_pekko_r2dbc_journal_lands_once_with_binary_payloads_kept(dsn: StoreDsn, warehouse: Path) -> None:
    """Pekko R2DBC's journal (its own slice column, bytea payloads): JSON payloads land as JSON, gzipped or
    binary ones as base64 that decodes to the stored bytes; deletion markers are not events."""
    source = mapping.pekko_r2dbc()
    rows = lands_once(dsn, PEKKO_R2DBC_DDL, source, r2dbc, warehouse)
    with psycopg.connect(dsn) as conn:
        stored = {(p, int(v)): bytes(b) for p, v, b in conn.execute(
            "SELECT persistence_id, seq_nr, event_payload FROM event_journal").fetchall()}
    for r in rows:
        raw = stored[(str(r["stream_id"]), int(r["version"]))]  # type: ignore[call-overload]
        if r["payload_encoding"] == "json":
            assert r["payload"] == raw.decode() and json.loads(str(r["payload"]))["n"] == r["version"]
        else:
            assert r["payload_encoding"] == "base64" and base64.b64decode(str(r["payload"])) == raw
    assert {r["payload_encoding"] for r in rows} == {"json", "base64"}
    assert {r["stream_type"] for r in rows} == {"Cart"}


def test_pekko_jdbc_journal_lands_once(dsn: StoreDsn, warehouse: Path) -> None:
    """Pekko JDBC's journal: `ordering` is the global position, the slice is hashed from the persistence id."""
    source = mapping.pekko_jdbc()
    rows = lands_once(dsn, PEKKO_JDBC_DDL, source, _jdbc, warehouse)
    assert {r["stream_type"] for r in rows} == {"Cart"}
    assert all(r["global_position"] is not None for r in rows)
    # A schema tool that drops what it does not know (Marten's) takes tx_id away: adopt will not add it back.
    # (A plain DROP COLUMN is refused: adopt's guard depends on the column; such a tool cascades.)
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.DependentObjectsStillExist):
            conn.execute("ALTER TABLE event_journal DROP COLUMN tx_id")
        conn.execute("ALTER TABLE event_journal DROP COLUMN tx_id CASCADE")
    with pytest.raises(SourceNotServable, match="tx_id is gone"):
        adopt(dsn, source, echo=lambda _: None)


def test_marten_events_land_once_with_their_tenants(dsn: StoreDsn, warehouse: Path) -> None:
    """Marten's mt_events (conjoined tenancy): tenant_id becomes the lake's tenant, mt_streams.type the stream type."""
    source = mapping.marten()
    rows = lands_once(dsn, MARTEN_DDL, source, _marten, warehouse)
    assert {r["tenant"] for r in rows} == {"*DEFAULT*", "tenant-b"}
    assert {r["stream_type"] for r in rows} == {"cart"}


def test_custom_toml_over_a_tenant_partitioned_table(dsn: StoreDsn, warehouse: Path, tmp_path: Path) -> None:
    """The design notes' hand-rolled `Event` table, one partition per tenant, described in TOML: adopt adds tx_id
    (a catalog-only change) and builds the indexes per partition; every tenant's events land once."""
    (tmp_path / "event.toml").write_text(SEED_TOML)
    source = mapping.load(str(tmp_path / "event.toml"))
    rows = lands_once(dsn, SEED_DDL, source, _seed, warehouse)
    assert {r["tenant"] for r in rows} == {"acme", "globex", "initech"}
    with psycopg.connect(dsn) as conn:
        indexes = {r[0] for r in conn.execute("SELECT indexname FROM pg_indexes WHERE schemaname = 'app'").fetchall()}
    assert {"Event_acme_es_slice_tx", "Event_acme_es_tx_order", "Event_es_slice_tx"} <= indexes


_FIVE = "stream_id = 'id'\nversion = 'v'\nevent_type = 't'\npayload = 'p'\nrecorded_at = 'at'\n"


@pytest.mark.parametrize("text, complaint", [
    ("[source]\ntable = ''\n", 'the events table as "schema.table"'),
    ("[source]\ntable = 'a.b'\nstream_id = 'id'\n", "missing version, event_type, payload, recorded_at"),
    ("[source]\ntable = 'a.b'\nstream_idd = 'id'\n", "only these keys"),
    ("[nothing]\n", "a [source] table"),
    ("[source\n", "a valid TOML file"),
    ("[source]\ntable = 'a.b'\nschema = 'a'\n", 'no schema key: the schema goes in table = "schema.b"'),
    (f"[source]\ntable = 'a.b'\n{_FIVE}also_reads = 'Streams'\n", 'a list of names, e.g. also_reads = ["Streams"]'),
    (f"[source]\ntable = 'a.b'\n{_FIVE}columns = [1]\n", "a list of names"),
    ("[source]\ntable = 'a.b'\nstream_id = 'id'\nversion = 1\n", "a string: a column name or SQL expression"),
])
def test_a_bad_toml_mapping_is_refused_with_what_to_write(tmp_path: Path, text: str, complaint: str) -> None:
    path = tmp_path / "m.toml"
    path.write_text(text)
    with pytest.raises(Exception, match=complaint.replace("[", r"\[")):
        mapping.load(str(path))


def test_a_mapping_file_is_read_whatever_its_name_ends_in(tmp_path: Path) -> None:
    path = tmp_path / "store.mapping"
    path.write_text(f"[source]\ntable = 'app.events'\n{_FIVE}also_reads = ['Streams']\n")
    source = mapping.load(str(path))
    assert (source.schema, source.table, source.also_reads) == ("app", "events", ("Streams",))


def test_a_pekko_journal_that_deleted_events_is_rebased_and_reconciled_by_what_it_holds(
    dsn: StoreDsn, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """`deleteEventsTo` takes events out of the store that the lake keeps: a rebase checks the lake against what
    the store still holds and says how many it cannot check, and the reconcile check passes on the same terms."""

    from es_pipeline.cli import main
    from es_pipeline.extraction.slices import SliceRange
    from es_pipeline_tests.support.lakecheck import events_checks

    source = mapping.pekko_jdbc()
    rng = random.Random(7)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(PEKKO_JDBC_DDL)
        for s in range(3):
            for v in range(1, 11):
                _jdbc(conn, "w", f"c{s}", v, rng)
    adopt(dsn, source, echo=lambda _: None)
    extractor = Extractor(dsn.extractor, None, warehouse, source=source)
    extractor.run(SliceRange(0, 1023))
    with psycopg.connect(dsn, autocommit=True) as conn:
        # deleteEventsTo(5), as pekko-persistence-jdbc's journal DAO does it: mark up to 5, delete below the mark.
        conn.execute("UPDATE event_journal SET deleted = true WHERE persistence_id = 'Cart|c0' AND sequence_number <= 5")
        conn.execute("DELETE FROM event_journal WHERE persistence_id = 'Cart|c0' AND sequence_number < 5")
        # The offsets then meet another cluster (as after a restore elsewhere): a rebase is asked for.
        conn.execute("UPDATE es_pipeline.sinks SET source_cluster = 'another cluster'")
    for key, value in {"ES_PIPELINE_PG_DSN": dsn.extractor, "ES_PIPELINE_WAREHOUSE": str(warehouse),
                       "ES_PIPELINE_SOURCE": "pekko-jdbc"}.items():
        monkeypatch.setenv(key, value)
    assert main(["offsets", "rebase"]) == 0
    assert "the 26 events of the lake that the store still holds are in it (4 more" in capsys.readouterr().out
    with psycopg.connect(dsn, autocommit=True) as conn:
        for v in (11, 12):
            _jdbc(conn, "w", "c1", v, rng)
    extractor.run(SliceRange(0, 1023), run_id="after")

    lake = Counter(zip(*DeltaTable(str(warehouse / "events")).to_pyarrow_table(
        columns=["stream_id", "version"]).to_pydict().values(), strict=True))
    with psycopg.connect(dsn) as conn:
        held = Counter(conn.execute(f"SELECT stream_id, version FROM {source.relation()} e").fetchall())  # type: ignore[arg-type]
    assert max(lake.values()) == 1, "an event landed twice"
    assert lake - held == Counter({("Cart|c0", v): 1 for v in range(1, 6)}), "the lake keeps what was deleted"
    assert not held - lake, "every event the store holds is in the lake"
    result = events_checks(spark, warehouse, dsn.extractor, source)["events_reconcile_with_source"]
    assert result.passed, result
    assert result.metadata["deleted_by_the_framework_unchecked"] == 5
