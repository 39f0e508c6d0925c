"""Migrations: idempotent, recorded, and refusing to touch an incompatible schema."""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable
from psycopg.conninfo import make_conninfo

from es_pipeline.errors import DatabaseUnreachable, IncompatibleSchema, PostgresTooOld
from es_pipeline.extraction import offsets
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.probe import probe
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.extraction.status import status_report
from es_pipeline.settings import Settings
from es_pipeline.store import migrations, roles
from es_pipeline.store.conninfo import check_server_version, connect
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline.store.migrations import MIGRATIONS, migrate
from es_pipeline_tests.support.lakecheck import source_events
from es_pipeline_tests.support.roles import create_login


def test_migrating_twice_is_a_no_op(empty_dsn: str) -> None:
    first = migrate(empty_dsn)
    second = migrate(empty_dsn)
    assert [m.version for m in first] == [m.version for m in MIGRATIONS]
    assert second == []
    with psycopg.connect(empty_dsn) as conn:
        rows = conn.execute("SELECT version FROM es.schema_migrations ORDER BY version").fetchall()
        assert [r[0] for r in rows] == [m.version for m in MIGRATIONS]
        types = dict(conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = 'es' AND table_name = 'events'"
        ).fetchall())
    assert types["tx_id"] == "xid8" and types["slice"] == "smallint"


def test_a_store_migrated_by_an_older_release_gets_the_new_migrations_only(
    empty_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrations, "MIGRATIONS", MIGRATIONS[:4])
    assert len(migrate(empty_dsn)) == 4
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO es.events (tx_id, stream_id, stream_type, version, event_type, payload) "
                     "VALUES ('3'::xid8, 'old-1', 'cart', 1, 'ItemAdded', '{}')")  # allowed before migration 5
    monkeypatch.setattr(migrations, "MIGRATIONS", MIGRATIONS)
    assert [m.version for m in migrate(empty_dsn)] == [m.version for m in MIGRATIONS[4:]]
    with psycopg.connect(empty_dsn) as conn, pytest.raises(psycopg.Error, match="append-only"):
        conn.execute("DELETE FROM es.events")


def test_incompatible_existing_table_is_refused_and_nothing_changes(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn) as conn:
        conn.execute("CREATE SCHEMA es; CREATE TABLE es.events (id serial, body text)")
    with pytest.raises(IncompatibleSchema, match=r"es\.events .*no column tx_id"):
        migrate(empty_dsn)
    with psycopg.connect(empty_dsn) as conn:
        tables = {r[0] for r in conn.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = 'es'")}
        schemas = {r[0] for r in conn.execute("SELECT nspname FROM pg_namespace")}
    assert tables == {"events"}, "no table was created"
    assert "es_pipeline" not in schemas


def test_unreachable_server_is_one_clear_line() -> None:
    with pytest.raises(DatabaseUnreachable) as info:
        connect("postgresql://postgres@127.0.0.1:1/nowhere")
    message = str(info.value)
    assert "127.0.0.1:1" in message and "'nowhere'" in message and "es-pipeline db start" in message
    assert "\n" not in message


def test_a_refused_password_says_so_and_not_to_start_a_server(pg_server: str) -> None:
    """The server answered: starting one is no advice; the user and password are what to check."""
    from psycopg.conninfo import conninfo_to_dict

    parts = {k: v for k, v in conninfo_to_dict(pg_server).items() if k != "passfile"}
    with pytest.raises(DatabaseUnreachable) as info:
        connect(make_conninfo(**{**parts, "password": "not-the-password"}))
    message = str(info.value)
    assert "password" in message and "refused them" in message and "db start" not in message, message
    assert "not-the-password" not in message


class _Info:
    server_version = 120011


class _OldServer:
    info = _Info()


def test_postgres_older_than_13_is_refused() -> None:
    with pytest.raises(PostgresTooOld, match="12 .* needs 13 or newer"):
        check_server_version(_OldServer())  # type: ignore[arg-type]


def test_an_already_migrated_store_needs_no_create_on_the_database(dsn: str) -> None:
    """A role a DBA would give the extractor has no CREATE on the database: `migrate` of a store that is up
    to date must then be a no-op, not `permission denied` (CREATE SCHEMA IF NOT EXISTS checks it first)."""
    role = f"es_no_create_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_login(conn, role)
        conn.execute(f"GRANT USAGE ON SCHEMA es TO {role}")
        conn.execute(f"GRANT SELECT ON es.schema_migrations TO {role}")
    try:
        with psycopg.connect(make_conninfo(dsn, user=role)) as conn:
            assert conn.execute("SELECT has_database_privilege(current_database(), 'CREATE')").fetchone() == (False,)
        assert migrate(make_conninfo(dsn, user=role)) == []
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


@pytest.mark.parametrize("schema", ["My Store", "es-prod", 'it"s'])
def test_a_schema_of_any_name_is_migrated_appended_extracted_and_reported(
    empty_dsn: str, logins: dict[str, str], tmp_path: Path, schema: str
) -> None:
    migrate(empty_dsn, schema)
    assert migrate(empty_dsn, schema) == []
    roles.apply(empty_dsn, schema, echo=lambda _: None)
    extractor = make_conninfo(empty_dsn, user=logins[roles.EXTRACTOR])
    store = EventStore(empty_dsn, schema)
    for i in range(5):
        store.append(f"s-{i}", "account", [NewEvent("Opened", {"i": i}), NewEvent("Deposited", {"n": 1})], 0)
    warehouse = tmp_path / "warehouse"
    result = Extractor(extractor, None, warehouse, schema=schema).run(SliceRange(0, 1023))
    assert result.rows == 10
    lake = DeltaTable(str(warehouse / "events")).to_pyarrow_table(columns=["stream_id", "version"])
    assert sorted(zip(lake["stream_id"].to_pylist(), lake["version"].to_pylist(), strict=True)) == [
        (f"s-{i}", v) for i in range(5) for v in (1, 2)
    ]
    settings = Settings.from_env({"ES_PIPELINE_PG_DSN": extractor, "ES_PIPELINE_SCHEMA": schema,
                                  "ES_PIPELINE_SLICE_RANGES": "1"})
    assert "0000-1023" in status_report(settings)
    with psycopg.connect(extractor) as conn:
        consumer = offsets.events_consumer(schema)  # this store's own offsets
        assert sum(offsets.counts_below_watermarks(conn, schema, consumer).values()) == 10
        found = probe(conn, schema, consumer)  # everything extracted: nothing ready, at a horizon no older
        assert found.ready_slices == frozenset() and found.horizon >= result.horizon


def test_two_stores_in_one_database_keep_their_own_offsets_and_lakes(
    empty_dsn: str, logins: dict[str, str], tmp_path: Path
) -> None:
    """Two schemas, two stores, two lakes: each store's consumer (`events`, `events:shop`) has its own offsets,
    sink, batches and locks, so extracting them by turns brings each event once into its own lake."""
    lakes = {"es": tmp_path / "es", "shop": tmp_path / "shop"}
    for schema in lakes:
        migrate(empty_dsn, schema)
        roles.apply(empty_dsn, schema, echo=lambda _: None)
    extractor = make_conninfo(empty_dsn, user=logins[roles.EXTRACTOR])
    for round_ in range(3):
        for n, schema in enumerate(lakes):
            store = EventStore(empty_dsn, schema)
            for i in range(4 + n):
                store.append(f"{schema}-{round_}-{i}", "doc", [NewEvent("Written", {"r": round_})], 0)
            Extractor(extractor, None, lakes[schema], schema=schema).run(SliceRange(0, 1023))
    for schema, lake in lakes.items():
        rows = DeltaTable(str(lake / "events")).to_pyarrow_table(columns=["stream_id", "version"])
        keys = list(zip(rows["stream_id"].to_pylist(), rows["version"].to_pylist(), strict=True))
        assert len(keys) == len(set(keys)) == len(source_events(empty_dsn, schema)) == 3 * (4 + list(lakes).index(schema))
        assert set(keys) == set(source_events(empty_dsn, schema))
    with psycopg.connect(empty_dsn) as conn:
        consumers = {r[0] for r in conn.execute("SELECT consumer FROM es_pipeline.sinks").fetchall()}
    assert consumers == {"events", "events:shop"}
