"""Dagster's storage keeps its connections: many statements and instances, no new server processes; a
connection the server dropped is replaced, never a failed statement."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from es_pipeline.instance import storage
from es_pipeline.settings import dagster_storage_url

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _backends(admin_dsn: str, database: str) -> set[int]:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                            (database,)).fetchall()
    return {pid for (pid,) in rows}


def _instance(home: Path) -> dg.DagsterInstance:
    """An instance from the project's own dagster.yaml (its storage: DAGSTER_PG_URL)."""
    home.mkdir(exist_ok=True)
    text = (PROJECT_ROOT / "dagster.yaml").read_text()
    assert "PooledPostgresStorage" in text, "dagster.yaml names the pooled storage"
    (home / "dagster.yaml").write_text(text)
    return dg.DagsterInstance.from_config(str(home))


def _statements(instance: dg.DagsterInstance, n: int) -> None:
    """`n` statements to each of the three storages."""
    for i in range(n):
        instance.get_runs(limit=1)
        instance.get_latest_materialization_event(dg.AssetKey(["events", str(i)]))
        instance.all_instigator_state()


def test_the_storage_keeps_a_few_connections_over_many_statements_and_instances(
    empty_dsn: str, pg_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts = conninfo_to_dict(empty_dsn)
    database = str(parts["dbname"])
    monkeypatch.setenv("DAGSTER_PG_URL", dagster_storage_url(
        str(parts["user"]), str(parts["host"]), str(parts["port"]), database, passfile=parts.get("passfile")))
    instance = _instance(tmp_path / "home")
    try:
        assert type(instance.run_storage).__module__ == storage.__name__
        _statements(instance, 1)
        first = _backends(pg_server, database)
        assert first, "connections stay open between statements"
        _statements(instance, 60)
        instance.dispose()
        for _ in range(5):  # the code server builds an instance per sensor tick
            with _instance(tmp_path / "home") as again:
                _statements(again, 5)
        after = _backends(pg_server, database)
        # None opened since (one of the first may have closed: a pool retires a connection it no longer needs).
        assert after and not after - first, f"255 statements over 6 instances opened {len(after - first)} new connections"
        assert len(after) <= 3 * storage.POOL_SIZE, "at most a few per storage"

        with psycopg.connect(pg_server, autocommit=True) as conn:  # the server drops them all (a restart, a timeout)
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (database,))
        monkeypatch.setattr(storage, "PING_AFTER_IDLE_SECONDS", 0.0)  # idle long enough to be checked
        with _instance(tmp_path / "home") as again:
            assert again.get_runs(limit=1) == []
            assert again.get_latest_materialization_event(dg.AssetKey("events")) is None
            assert again.all_instigator_state() == []
    finally:
        storage.close_engines()
    assert not _backends(pg_server, database), "closing the engines closes their connections"
