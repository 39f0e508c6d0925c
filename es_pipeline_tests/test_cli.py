"""Bad input at the command line: one line that says what is wrong and what to do, exit 2, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from es_pipeline_tests.support.roles import StoreDsn, create_login

CLI = str(Path(sys.executable).parent / "es-pipeline")


def _cli(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
                          check=False)


def _one_line(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    for w in words:
        assert w in done.stderr, done.stderr


def test_an_unwritable_warehouse(dsn: str, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    done = _cli(["extract"], ES_PIPELINE_PG_DSN=dsn, ES_PIPELINE_WAREHOUSE=str(blocker / "warehouse"))
    _one_line(done, "warehouse cannot be written", "ES_PIPELINE_WAREHOUSE")


@pytest.mark.parametrize("command", [["extract"], ["status"]])
def test_a_store_never_migrated(empty_dsn: str, tmp_path: Path, command: list[str]) -> None:
    done = _cli(command, ES_PIPELINE_PG_DSN=empty_dsn, ES_PIPELINE_WAREHOUSE=str(tmp_path / "w"))
    _one_line(done, "not migrated", "es-pipeline db migrate")
    assert not (tmp_path / "w").exists(), "nothing was created"


def test_a_role_without_grants(dsn: str, tmp_path: Path) -> None:
    role = f"es_no_grants_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_login(conn, role)
    try:
        done = _cli(["status"], ES_PIPELINE_PG_DSN=make_conninfo(dsn, user=role))
        _one_line(done, "lacks a privilege", "permission denied")
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP ROLE {role}")


def test_db_roles_prints_what_it_grants_and_can_run_again(dsn: str) -> None:
    first = _cli(["db", "roles"], ES_PIPELINE_PG_DSN=dsn)
    again = _cli(["db", "roles"], ES_PIPELINE_PG_DSN=dsn)
    assert first.returncode == again.returncode == 0, first.stderr
    assert 'GRANT pg_read_all_stats TO "es_pipeline_extractor";' in first.stdout
    assert first.stdout == again.stdout


def test_tenant_commands_refuse_in_one_line(dsn: str, tmp_path: Path) -> None:
    env = {"ES_PIPELINE_PG_DSN": dsn, "ES_PIPELINE_WAREHOUSE": str(tmp_path / "w")}
    _one_line(_cli(["tenant", "erase", "acme"], **env), "cannot be undone", "--yes")
    _one_line(_cli(["tenant", "erase", "acme", "--yes"], **env), "cannot erase tenant 'acme'", "has no tenants")
    _one_line(_cli(["tenant", "add", "acme"], **env), "cannot add tenant 'acme'", "not es_pipeline's store partitioned")
    _one_line(_cli(["db", "migrate"], ES_PIPELINE_SOURCE="es-tenants", **env),
              "created without tenants", "ES_PIPELINE_SOURCE=es-tenants")


def test_tenant_add_then_erase_from_the_command_line(empty_dsn: str, tmp_path: Path) -> None:
    env = {"ES_PIPELINE_PG_DSN": empty_dsn, "ES_PIPELINE_WAREHOUSE": str(tmp_path / "w"), "ES_PIPELINE_SOURCE": "es-tenants"}
    assert _cli(["db", "migrate"], **env).returncode == 0
    added = _cli(["tenant", "add", "acme"], **env)
    assert added.returncode == 0 and "events_t_acme_" in added.stdout and "created" in added.stdout, added.stderr
    assert "exists already" in _cli(["tenant", "add", "acme"], **env).stdout
    erased = _cli(["tenant", "erase", "acme", "--yes"], **env)
    assert erased.returncode == 0, erased.stderr
    assert "erased tenant 'acme': dropped es.events_t_acme_" in erased.stdout
    assert "no Parquet file of the lake holds the tenant" in erased.stdout


@pytest.mark.slow
def test_sql_answers_by_duckdb_as_a_table_csv_or_json_and_refuses_a_bad_query_in_one_line(
    dsn: StoreDsn, tmp_path: Path
) -> None:
    from es_pipeline.dev.workload import run_workload
    from es_pipeline.domain import NO_DOMAIN
    from es_pipeline.lake.typed import event_tables
    from es_pipeline.store.event_store import EventStore
    from es_pipeline_tests.support.lakecheck import extract_all

    warehouse = tmp_path / "w"
    run_workload(EventStore(dsn), streams=10, events=120, writers=2, rollback_rate=0, max_commit_delay=0, seed=1)
    extract_all(dsn.extractor, None, warehouse)
    event_tables.update(warehouse, NO_DOMAIN)
    env = {"ES_PIPELINE_PG_DSN": dsn.extractor, "ES_PIPELINE_WAREHOUSE": str(warehouse)}
    query = ("SELECT e.event_type, count(*) AS n FROM events e JOIN event_tables m ON m.event_type = e.event_type "
             "AND m.column_name = '_overflow' GROUP BY 1 ORDER BY 1")
    shown = _cli(["sql", query], **env)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["event_type", "|", "n"] and set(lines[1]) <= {"-", "+"}
    assert lines[-1].endswith("rows)") and len(lines) > 4
    as_json = _cli(["sql", query, "--format", "json"], **env)
    counted = {r["event_type"]: r["n"] for r in map(json.loads, as_json.stdout.splitlines())}
    assert sum(counted.values()) == 120
    deposits = _cli(["sql", "SELECT count(*) AS n, round(sum(amount), 2) AS total FROM events_deposited",
                     "--format", "csv"], **env)
    n, total = deposits.stdout.splitlines()[1].split(",")
    assert int(n) == counted["Deposited"] and float(total) > 0
    _one_line(_cli(["sql", "SELECT nope FROM events"], **env), "duckdb could not run the query", "nope",
              "The lake's tables: events, event_tables, events_")
