"""Every table by name from any SQL client (lake/read/metastore.py, lake/read/endpoint.py): a Hive metastore in a
PostgreSQL database its own login owns, Spark's Thrift server on it, and the catalog kept equal to the lake through a
reducer revision's swap, a tenant's erasure, a new event type and a lake rebuild.

Every part is real and in its own process, as an analyst meets it: `es-pipeline catalog sync` and `sql-endpoint`,
beeline (pyspark's), impyla (a Python DB-API client), and a new Spark session that never saw the lake running
docs/analysts.md's notebook lines. The answers are compared with `es-pipeline sql` (DuckDB over the Delta files) and
with the store.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from shop.domain import domain as SHOP

from es_pipeline.checks import Given
from es_pipeline.checks.catalog import matches_lake
from es_pipeline.dev.stack import free_port
from es_pipeline.dev.workload import run_workload
from es_pipeline.extraction.erase import erase_tenant
from es_pipeline.extraction.rebuild import rebuild as lake_rebuild
from es_pipeline.lake import cross_stream
from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog
from es_pipeline.lake.follow import follow
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.read import metastore
from es_pipeline.lake.state import rebuild
from es_pipeline.lake.state.snapshots import take_snapshots
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.lake.typed import event_tables
from es_pipeline.settings import PROJECT_ROOT, Settings
from es_pipeline.source.mapping import load
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.lake.test_rebuild import bumped
from es_pipeline_tests.support.hooks import no_spark
from es_pipeline_tests.support.lakecheck import extract_all
from es_pipeline_tests.support.roles import StoreDsn, create_login
from es_pipeline_tests.support.store import make_tenant_store

pytestmark = pytest.mark.slow

SOURCE = load("es-tenants")
TENANTS = ("acme", "globex")
BIN = Path(sys.executable).parent
BEELINE = Path(__import__("pyspark").__file__).parent / "bin" / "beeline"
ANALYSTS = PROJECT_ROOT / "docs" / "analysts.md"
HERE = Engine(spark=no_spark)
PASSWORD = "Analyst-passphrase-7q"  # beeline's script splits its arguments on spaces
SECRET = {"ES_PIPELINE_NEW_USER_PASSWORD": PASSWORD}
DBAPI_CLIENT = """
import json, sys
from impala.dbapi import connect
import os
cursor = connect(host="127.0.0.1", port=int(sys.argv[1]), auth_mechanism="PLAIN", user="analyst",
                 password=os.environ["ENDPOINT_PASSWORD"], database="es").cursor()
cursor.execute(sys.argv[2])
print(json.dumps([list(row) for row in cursor.fetchall()], default=str))
"""


def doc_questions() -> list[str]:
    """The queries of docs/analysts.md's "Three questions", as its `es-pipeline sql "..."` lines give them."""
    text = ANALYSTS.read_text()
    section = text[text.index("## Three questions"):text.index("## Any past moment")]
    return [" ".join(q.split()) for q in re.findall(r'es-pipeline sql "(.*?)"', section, flags=re.S)]


def doc_notebook_lines() -> str:
    """docs/analysts.md's lines that give a notebook's Spark session the catalog."""
    text = ANALYSTS.read_text()
    start = text.index("from es_pipeline.lake.read.metastore import spark_with_catalog")
    return text[start:text.index("\n\n", start)]


def cells(rows: list[list[Any]]) -> list[tuple[str, ...]]:
    """Rows as comparable text: numbers to two places (each engine prints a double its own way), NULL as ''."""
    def cell(value: Any) -> str:
        text = "" if value is None or value in ("NULL",) else str(value)
        try:
            return f"{float(text):.2f}"
        except ValueError:
            return text
    return [tuple(cell(v) for v in row) for row in rows]


def comparable(query: str, rows: list[list[Any]]) -> list[tuple[str, ...]]:
    """What two engines must agree on: every row, in any order; for a LIMIT, the sort column's values (ties
    at the limit may pick different rows)."""
    found = cells(rows)
    if " LIMIT " in query:
        return sorted((row[1],) for row in found)
    return sorted(found)


def _build(store: StoreDsn, warehouse: Path, domain: Any = SHOP, *, daily: bool = True) -> None:
    """The lake up to the store: `events` and every kind of table built from it (`event_type_daily` where `daily`),
    in process, without Spark."""
    extract_all(store.extractor, None, warehouse, source=SOURCE)
    update_stream_state(HERE, warehouse, domain=domain, store_dsn=store.extractor)
    update_stream_catalog(HERE, warehouse, store_dsn=store.extractor)
    if daily:
        update_event_type_daily(HERE, warehouse, store_dsn=store.extractor)
    event_tables.update(warehouse, domain, store_dsn=store.extractor, engine=HERE)
    cross_stream.update(warehouse, domain, "sku_sales", store_dsn=store.extractor, engine=HERE)


@pytest.fixture
def catalog_dsn(pg_server: str) -> Any:
    """A catalog database owned by a login of its own, which may do nothing else (not a superuser, no role of the
    store): the least privilege docs/analysts.md asks for."""
    login, name = f"t_catalog_{os.getpid()}", f"metastore_t{os.getpid()}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        create_login(conn, login)
        conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), sql.Identifier(login)))
    yield make_conninfo(pg_server, user=login, dbname=name)
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(login)))


def test_every_table_by_name_through_the_catalog_a_new_session_and_the_sql_endpoint_kept_equal_to_the_lake(
    empty_dsn: str, logins: dict[str, str], warehouse: Path, catalog_dsn: str, tmp_path: Path
) -> None:
    make_tenant_store(empty_dsn, *TENANTS)
    store = StoreDsn.of(empty_dsn, logins)
    run_workload(EventStore(store.writer), streams=40, events=800, writers=3, rollback_rate=0.1,
                 max_commit_delay=0.005, seed=64, tenants=list(TENANTS))
    _build(store, warehouse)
    take_snapshots(HERE, warehouse, EventStore(store.snapshots), threshold=3)
    settings = replace(Settings.from_env(), pg_dsn=str(store), warehouse=warehouse, source_mapping=SOURCE,
                       source_spec="es-tenants", spark_master="local[2]", metastore_dsn=catalog_dsn)
    ms = metastore.Metastore.required(settings)
    env = {**os.environ, "ES_PIPELINE_PG_DSN": str(store), "ES_PIPELINE_SOURCE": "es-tenants",
           "ES_PIPELINE_WAREHOUSE": str(warehouse), "ES_PIPELINE_DOMAIN": "shop.domain",
           "ES_PIPELINE_METASTORE_DSN": catalog_dsn, "ES_PIPELINE_SPARK_MASTER": "local[2]"}

    def cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(BIN / "es-pipeline"), *args], env=env, capture_output=True, text=True, timeout=600)
        if ok:
            assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        return done

    def names_in_postgres() -> set[str]:
        """The catalog's tables as PostgreSQL holds them (no JVM, no es_pipeline code), all external."""
        with psycopg.connect(catalog_dsn) as conn:
            rows = conn.execute('SELECT t."TBL_NAME", t."TBL_TYPE" FROM "TBLS" t JOIN "DBS" d USING ("DB_ID") '
                                'WHERE d."NAME" = %s', [ms.schema]).fetchall()
        assert {kind for _, kind in rows} <= {"EXTERNAL_TABLE"}
        return {name for name, _ in rows}

    lake = set(metastore.wanted(warehouse))
    assert {"events", "stream_state", "stream_state_cart", "stream_state_account_history", "sku_sales",
            "events_item_added", "event_tables", "snapshots", "stream_catalog", "event_type_daily"} <= lake
    # Before any sync the check passes (nothing claims to be synced); `show` says what a sync would do.
    assert matches_lake(Given(HERE, warehouse, str(store), SOURCE, metastore=ms)).passed
    # The catalog's login is no superuser: the metastore's tables are made by it, in the database it owns.
    with psycopg.connect(catalog_dsn) as conn:
        assert conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone() == (False,)

    # 1. The SQL endpoint, up for the rest of the test. Bound to another address with no authentication, it refuses
    # to start; here it asks for a password (the mode that may listen elsewhere), of a user added as an operator does.
    refused = cli("sql-endpoint", "--host", "0.0.0.0", ok=False)
    assert refused.returncode == 2 and "ES_PIPELINE_SQL_ENDPOINT_AUTH=password" in refused.stderr
    env |= {"ES_PIPELINE_SQL_ENDPOINT_AUTH": "password", "ES_PIPELINE_SQL_ENDPOINT_USERS": str(tmp_path / "users")}
    subprocess.run(
        [str(BIN / "es-pipeline"), "sql-endpoint", "--add-user", "analyst"], env={**env, **SECRET}, check=True,
        capture_output=True)
    assert PASSWORD not in (tmp_path / "users").read_text() and (tmp_path / "users").stat().st_mode & 0o077 == 0
    port = free_port()
    said = tmp_path / "endpoint.out"
    with said.open("w") as out:
        server = subprocess.Popen([str(BIN / "es-pipeline"), "sql-endpoint", "--port", str(port)], env=env,
                                  stdout=out, stderr=subprocess.DEVNULL)
    try:
        # 2. Its first sync (the catalog's own, in a process of its own) makes the metastore's tables (DataNucleus's
        # SchemaTool) and registers every table; a second sync has nothing to do and starts no JVM.
        _until(lambda: _names(catalog_dsn, ms.schema) == lake, server, said)
        assert names_in_postgres() == lake
        assert said.read_text().count("catalog: registered es.") == len(lake)
        assert catalog_dsn not in said.read_text()
        again = cli("catalog", "sync")
        assert f"{len(lake)} tables in `es`, 0 registered, 0 dropped (nothing to change, no JVM started" in \
            again.stdout, again.stdout

        # 3. Meanwhile the server starts: a new Spark session that never saw the lake runs docs/analysts.md's
        # notebook lines.
        notebook = tmp_path / "notebook.py"
        notebook.write_text(doc_notebook_lines() + "\nprint('TABLES', sorted(t.name for t in spark.catalog.listTables()))"
                            "\nprint('EVENTS', spark.table('es.events').count())\n")
        seen = subprocess.run([sys.executable, str(notebook)], env=env, capture_output=True, text=True, timeout=600,
                              cwd=tmp_path)
        assert seen.returncode == 0, seen.stderr[-3000:]
        assert f"TABLES {sorted(lake)}" in seen.stdout
        with psycopg.connect(str(store)) as conn:
            in_store = conn.execute("SELECT count(*) FROM es.events").fetchone()[0]  # type: ignore[index]
        assert f"EVENTS {in_store}" in seen.stdout
        assert re.search(r"^\| *cart *\| *\d+ *\|$", seen.stdout, flags=re.M), seen.stdout

        url = _endpoint_url(server, said)
        assert url == f"jdbc:hive2://127.0.0.1:{port}/es"

        def duckdb(query: str) -> list[list[Any]]:
            out = cli("sql", query, "--format", "csv").stdout
            return [row for row in csv.reader(io.StringIO(out))][1:]

        def beeline(query: str) -> list[list[Any]]:
            done = subprocess.run([str(BEELINE), "-u", url, "-n", "analyst", "-p", PASSWORD, "--silent=true",
                                   "--outputformat=csv2",
                                   "--showHeader=true", "-e", query], capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "SPARK_SUBMIT_OPTS": "-XX:TieredStopAtLevel=1"})
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            # The header follows beeline's prompt on its line (`0: jdbc:hive2://...> sku,units,revenue`).
            lines = [re.sub(r"^\d+: jdbc:\S+> ", "", line) for line in done.stdout.splitlines() if line.strip()]
            return [row for row in csv.reader(lines)][1:]

        def dbapi(query: str, password: str = PASSWORD) -> list[list[Any]]:
            """The query through impyla, a Python DB-API client of HiveServer2's protocol, in a process of its own
            (thrift's C decoder leaves the interpreter's recursion count raised behind it)."""
            done = subprocess.run([sys.executable, "-c", DBAPI_CLIENT, str(port), query], capture_output=True,
                                  text=True, timeout=300, env={**os.environ, "ENDPOINT_PASSWORD": password})
            assert done.returncode == 0, done.stderr[-3000:]
            return json.loads(done.stdout)

        with pytest.raises(AssertionError, match="Error validating the login"):
            dbapi("SELECT 1", password="not-" + PASSWORD)

        # 4. docs/analysts.md's questions: the same answers from beeline, from Python's DB-API and from DuckDB.
        questions = doc_questions()
        assert len(questions) == 3
        for query in questions:
            expected = comparable(query, duckdb(query))
            assert expected, query
            assert comparable(query, dbapi(query)) == expected, query
        assert comparable(questions[0], beeline(questions[0])) == comparable(questions[0], duckdb(questions[0]))

        # 5. A reducer revision, rebuilt beside and swapped in: the endpoint's next query sees the new states, with
        # nothing registered (the table's location is the same; its schema is in its Delta log).
        two = bumped(SHOP, 2)
        follow(warehouse, store.extractor, two)
        assert rebuild.run_pending(HERE, warehouse, two, store.extractor) == ["cart"]
        carts = dbapi("SELECT count(*) FROM stream_state WHERE stream_type = 'cart'")[0][0]
        revision = two.folds["cart"].revision
        assert revision != SHOP.folds["cart"].revision
        assert dbapi(f"SELECT count(*) FROM stream_state WHERE stream_type = 'cart' AND revision = {revision} AND "
                     "get_json_object(state, '$.seen') IS NOT NULL")[0][0] == carts > 0
        assert metastore.difference(ms, warehouse).describe() == "none"

        # 6. A tenant erased: gone from every table at once, as the endpoint reads them; the catalog unchanged.
        erase_tenant(settings, "globex", progress=lambda _: None)
        assert dbapi("SELECT count(*) FROM events WHERE tenant = 'globex'") == [[0]]
        assert dbapi("SELECT count(*) FROM stream_state WHERE tenant = 'globex'") == [[0]]
        with psycopg.connect(str(store)) as conn:
            acme = conn.execute("SELECT count(*) FROM es.events").fetchone()[0]  # type: ignore[index]
        assert dbapi("SELECT count(*) FROM events") == [[acme]]
        assert not metastore.difference(ms, warehouse)

        # 7. A lake rebuild removes two tables: until a sync the catalog names tables the lake has not, and the
        # check says so.
        lake_rebuild(str(store), SOURCE, warehouse, ["stream_catalog", "event_type_daily"], say=lambda _: None)
        diff = metastore.difference(ms, warehouse)
        assert diff.extra == ["event_type_daily", "stream_catalog"] and not diff.missing
        failed = matches_lake(Given(HERE, warehouse, str(store), SOURCE, metastore=ms))
        assert not failed.passed and failed.metadata["tables_not_in_lake"] == 2
        assert cli("catalog", "show", ok=False).returncode == 1

        # 8. A new event type makes a new typed event table, and `stream_catalog` is built again (at its location:
        # its name holds); `event_type_daily` is not, yet. One sync registers the one and drops the other, and the
        # endpoint that was up all along answers from the new and the rebuilt tables.
        EventStore(store.writer).append("audit-1", "audit", [NewEvent("NoteTaken", {"words": 3}),
                                                            NewEvent("NoteTaken", {"words": 4})], 0, tenant="acme")
        _build(store, warehouse, two, daily=False)
        lake = set(metastore.wanted(warehouse))
        assert "events_note_taken" in lake and "stream_catalog" in lake and "event_type_daily" not in lake
        diff = metastore.difference(ms, warehouse)
        assert (set(diff.missing), diff.extra) == ({"events_note_taken"}, ["event_type_daily"])
        synced = cli("catalog", "sync")
        assert "1 registered, 1 dropped" in synced.stdout, synced.stdout
        assert names_in_postgres() == lake
        assert matches_lake(Given(HERE, warehouse, str(store), SOURCE, metastore=ms)).passed
        assert dbapi("SELECT sum(words), count(*) FROM events_note_taken") == [[7, 2]]
        with psycopg.connect(str(store)) as conn:
            streams = conn.execute("SELECT count(DISTINCT stream_id) FROM es.events").fetchone()[0]  # type: ignore[index]
        assert dbapi("SELECT count(*) FROM stream_catalog") == [[streams]]
        shown = cli("catalog", "show")
        assert shown.stdout.strip().endswith("against the lake: none")
    finally:
        server.terminate()
        server.wait(60)


def _endpoint_url(server: subprocess.Popen[bytes], said: Path, timeout: float = 300) -> str:
    """The address the endpoint prints once it listens."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"SQL endpoint on (jdbc:hive2://\S+)", said.read_text())
        if found:
            return found.group(1)
        if server.poll() is not None:
            raise AssertionError(f"the SQL endpoint ended (exit {server.returncode}): {said.read_text()[-2000:]}")
        time.sleep(0.5)
    raise AssertionError("the SQL endpoint did not start")


def _names(catalog_dsn: str, schema: str) -> set[str] | None:
    """The catalog's table names in PostgreSQL, or None before its tables are made."""
    try:
        with psycopg.connect(catalog_dsn) as conn:
            rows = conn.execute('SELECT t."TBL_NAME" FROM "TBLS" t JOIN "DBS" d USING ("DB_ID") WHERE d."NAME" = %s',
                                [schema]).fetchall()
    except psycopg.errors.UndefinedTable:
        return None
    return {name for (name,) in rows}


def _until(done: Any, server: subprocess.Popen[bytes], said: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if server.poll() is not None:
            raise AssertionError(f"the SQL endpoint ended (exit {server.returncode}): {said.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not done in {timeout:.0f} s: {said.read_text()[-2000:]}")
        time.sleep(0.5)
