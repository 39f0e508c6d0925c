"""Migrations: idempotent, recorded, and refusing to touch an incompatible schema."""

from __future__ import annotations

import psycopg
import pytest

from es_pipeline.errors import DatabaseUnreachable, IncompatibleSchema, PostgresTooOld
from es_pipeline.store import migrations
from es_pipeline.store.conninfo import check_server_version, connect
from es_pipeline.store.migrations import MIGRATIONS, migrate


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


class _Info:
    server_version = 120011


class _OldServer:
    info = _Info()


def test_postgres_older_than_13_is_refused() -> None:
    with pytest.raises(PostgresTooOld, match="12 .* needs 13 or newer"):
        check_server_version(_OldServer())  # type: ignore[arg-type]
