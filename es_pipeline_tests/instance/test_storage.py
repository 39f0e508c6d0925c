"""Dagster's storage keeps its connections: many statements, no new server processes; a connection the
server dropped is replaced, never a failed statement."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from es_pipeline.instance.storage import PooledPostgresStorage
from es_pipeline.settings import dagster_storage_url

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _backends(admin_dsn: str, database: str) -> set[int]:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                            (database,)).fetchall()
    return {pid for (pid,) in rows}


def _instance(empty_dsn: str, home: Path, monkeypatch: pytest.MonkeyPatch) -> dg.DagsterInstance:
    """An instance from the project's own dagster.yaml, its storage in a fresh database."""
    parts = conninfo_to_dict(empty_dsn)
    url = dagster_storage_url(str(parts["user"]), str(parts["host"]), str(parts["port"]), str(parts["dbname"]),
                              passfile=parts.get("passfile"))
    home.mkdir()
    text = (PROJECT_ROOT / "dagster.yaml").read_text()
    assert "PooledPostgresStorage" in text, "dagster.yaml names the pooled storage"
    (home / "dagster.yaml").write_text(text)
    monkeypatch.setenv("DAGSTER_PG_URL", url)
    return dg.DagsterInstance.from_config(str(home))


def test_the_storage_keeps_a_few_connections_over_many_statements(
    empty_dsn: str, pg_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = str(conninfo_to_dict(empty_dsn)["dbname"])
    instance = _instance(empty_dsn, tmp_path / "home", monkeypatch)
    try:
        assert type(instance.run_storage).__module__ == PooledPostgresStorage.__module__
        instance.get_runs(limit=1)
        instance.get_latest_materialization_event(dg.AssetKey("events"))
        instance.all_instigator_state()  # one statement to each of the three storages
        first = _backends(pg_server, database)
        assert first, "connections stay open between statements"
        for i in range(60):
            instance.get_runs(limit=1)
            instance.get_latest_materialization_event(dg.AssetKey(["events", str(i)]))
            instance.all_instigator_state()
        after = _backends(pg_server, database)
        assert after == first, f"180 statements opened no new connection: {len(after - first)} new"
        assert len(after) <= 3 * 3, "at most a few per storage"

        with psycopg.connect(pg_server, autocommit=True) as conn:  # the server drops them all (a restart, a timeout)
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (database,))
        assert instance.get_runs(limit=1) == []
        assert instance.get_latest_materialization_event(dg.AssetKey("events")) is None
    finally:
        instance.dispose()
    assert not _backends(pg_server, database), "disposing the instance closes its connections"
