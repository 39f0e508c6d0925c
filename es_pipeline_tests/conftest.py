"""Shared fixtures: the real local Postgres server, one database per test, one Spark session."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from es_pipeline.dev import local_server
from es_pipeline.dev.s3proxy import S3Server, s3proxy
from es_pipeline.lake.spark import get_spark
from es_pipeline.settings import Settings, local_pg_dsn
from es_pipeline.store import roles
from es_pipeline.store.migrations import migrate
from es_pipeline_tests.support.roles import StoreDsn, create_login, login_roles
from es_pipeline_tests.support.store import make_tenant_store


def _worker_cluster() -> None:
    """Under pytest-xdist (`make pytest` runs two workers), each worker on a PostgreSQL cluster of its own, as each
    major of `make test-pg-versions` is: the horizon, `pg_snapshot_xmin`, is the cluster's, so a transaction one
    worker's test holds open would hold the other's extractions back, and drills that end the cluster's backends
    would end the other's. Set before anything reads the port; the cluster goes when the worker ends."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or "ES_PIPELINE_TEST_PG_ADMIN_DSN" in os.environ:  # one process, or a run given its cluster
        return
    import atexit
    import shutil

    from es_pipeline.dev.stack import free_port
    from es_pipeline.settings import PROJECT_ROOT

    port, data = free_port(), PROJECT_ROOT / ".pgdata" / f"xdist-{worker}-{os.getpid()}"
    local_server.start(port, data)
    os.environ["ES_PIPELINE_TEST_PG_ADMIN_DSN"] = local_pg_dsn(port, "postgres")
    os.environ["ES_PIPELINE_LOCAL_PG_PORT"] = str(port)

    def gone() -> None:
        local_server.stop(data)
        shutil.rmtree(data, ignore_errors=True)
        (data.parent / f"{data.name}.log").unlink(missing_ok=True)

    atexit.register(gone)


_worker_cluster()
# No catalog (lake/read/metastore.py) unless a test names one: its sensor would sync every stack's lake into one
# shared `metastore` database. e2e/test_catalog_endpoint.py proves the catalog; lake/test_s3_lake.py its sync on S3.
os.environ.setdefault("ES_PIPELINE_METASTORE_DSN", "off")
LOCAL_PG_PORT = Settings.from_env().local_pg_port
ADMIN_DSN = local_pg_dsn(LOCAL_PG_PORT, "postgres")
TEMPLATE_DB = f"es_test_template_{os.getpid()}"
_counter = itertools.count()


def _dsn(db: str) -> str:
    return local_pg_dsn(LOCAL_PG_PORT, db)


@pytest.fixture(scope="session")
def pg_server() -> str:
    if "ES_PIPELINE_TEST_PG_ADMIN_DSN" not in os.environ:
        local_server.start(LOCAL_PG_PORT)
    return os.environ.get("ES_PIPELINE_TEST_PG_ADMIN_DSN", ADMIN_DSN)


@pytest.fixture(scope="session")
def template_db(pg_server: str) -> Iterator[str]:
    """A migrated database with the role model applied, that every test's database is cloned from
    (CREATE DATABASE … TEMPLATE keeps the grants)."""
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE_DB}"')
        conn.execute(f'CREATE DATABASE "{TEMPLATE_DB}"')
    migrate(_dsn(TEMPLATE_DB))
    roles.apply(_dsn(TEMPLATE_DB), "es", echo=lambda _: None)
    yield TEMPLATE_DB
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE_DB}" WITH (FORCE)')


@pytest.fixture(scope="session")
def logins(pg_server: str, template_db: str) -> Iterator[dict[str, str]]:
    """The session's login roles, one per group role: {group role: login role}."""
    with login_roles(pg_server) as made:
        yield made


@pytest.fixture
def dsn(pg_server: str, template_db: str, logins: dict[str, str]) -> Iterator[StoreDsn]:
    """A fresh, migrated database for one test: a superuser's DSN, with `.extractor` (what es_pipeline
    runs as), `.writer` and `.snapshots`."""
    name = f"es_test_{os.getpid()}_{next(_counter)}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield StoreDsn.of(_dsn(name), logins)
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def new_store(pg_server: str, template_db: str, logins: dict[str, str]) -> Iterator[Callable[[], StoreDsn]]:
    """A maker of fresh, migrated databases like `dsn`'s, for a test that needs one per example (a property
    test); every one is dropped when the test ends."""
    made: list[str] = []

    def make() -> StoreDsn:
        name = f"es_test_{os.getpid()}_{next(_counter)}"
        with psycopg.connect(pg_server, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
        made.append(name)
        return StoreDsn.of(_dsn(name), logins)

    yield make
    with psycopg.connect(pg_server, autocommit=True) as conn:
        for name in made:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def empty_dsn(pg_server: str) -> Iterator[str]:
    """A fresh database with no migrations applied."""
    name = f"es_test_empty_{os.getpid()}_{next(_counter)}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield _dsn(name)
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def tenant_store(empty_dsn: str, logins: dict[str, str]) -> StoreDsn:
    """A fresh store partitioned by tenant (`es-tenants`) with tenants acme and globex; logins as `dsn`'s."""
    make_tenant_store(empty_dsn, "acme", "globex")
    return StoreDsn.of(empty_dsn, logins)


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One real S3 server (s3proxy) for the test session. Its AWS_* variables are in this process's
    environment for the session: delta-rs, pyarrow and the Spark session's S3A all read them there."""
    with s3proxy(tmp_path_factory.mktemp("s3proxy") / "objects") as server:
        saved = {k: os.environ.get(k) for k in server.client_env()}
        os.environ.update(server.client_env())
        try:
            yield server
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture(scope="session")
def spark(s3: S3Server):  # type: ignore[no-untyped-def]
    """One Spark session for the whole test session, at local[2], that reaches local lakes and the S3 server's
    (started with S3A, as a session for an s3:// warehouse is)."""
    settings = replace(Settings.from_env(), warehouse=s3.bucket("spark"), spark_master="local[2]")
    # This JVM lives as long as the worker: the JIT's every tier and the default collector pay off here. The
    # Makefile's SPARK_SUBMIT_OPTS (the client compiler alone, the serial collector) is for the short-lived ones:
    # the runs and servers the tests start (the environment is the launcher's, read as the JVM starts). A run whose
    # Spark work is light (the other majors' tests: small reads; ES_PIPELINE_TEST_LIGHT_SPARK) keeps them for its
    # session too: its JVM's CPU 64 s → 43 s.
    light = os.environ.get("ES_PIPELINE_TEST_LIGHT_SPARK") == "1"
    short_lived = None if light else os.environ.pop("SPARK_SUBMIT_OPTS", None)
    try:
        session = get_spark(settings)
    finally:
        if short_lived is not None:
            os.environ["SPARK_SUBMIT_OPTS"] = short_lived
    yield session
    session.stop()


@pytest.fixture
def warehouse(tmp_path: Path) -> Path:
    path = tmp_path / "warehouse"
    path.mkdir()
    return path


@pytest.fixture
def settings(dsn: StoreDsn, warehouse: Path) -> Settings:
    """es_pipeline's settings for one test: it logs in as the extractor role."""
    return replace(Settings.from_env(), pg_dsn=dsn.extractor, warehouse=warehouse, spark_master="local[2]")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tiers: a test that takes the `spark` fixture is marked `spark`, one that takes `s3` `s3`, one under
    e2e/ `e2e`. `make check` runs the rest (`-m "not spark and not s3 and not e2e"`): the pure tests and
    those against Postgres.
    """
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.spark)
        if "s3" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.e2e)
    # The longest files first, each test in its file's order: two xdist workers handed files in this order end
    # together, instead of one running the Spark cluster drill alone at the end (longest processing time first).
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    e2e = {name: i for i, name in enumerate(E2E_ORDER)}
    items.sort(key=lambda item: (rank.get(item.path.relative_to(item.config.rootpath).as_posix(), len(rank)),
                                 e2e.get(item.originalname if isinstance(item, pytest.Function) else item.name,
                                         len(e2e))))


# Each file's share of `make pytest`, longest first (`make test`'s report lists the slowest tests: a new drill that
# takes minutes goes here, near its peers).
LONGEST_FILES_FIRST = (
    "es_pipeline_tests/lake/test_spark_cluster.py",
    "es_pipeline_tests/extraction/test_crash_drill.py",
    "es_pipeline_tests/extraction/test_extractor.py",
    "es_pipeline_tests/lake/test_interop.py",
    "es_pipeline_tests/lake/test_projections.py",
    "es_pipeline_tests/lake/test_stream_state.py",
    "es_pipeline_tests/lake/test_history.py",
    "es_pipeline_tests/lake/test_s3_lake.py",
    "es_pipeline_tests/lake/test_matrix.py",
    "es_pipeline_tests/test_materialize_cli.py",
)

# The e2e tier's tests (`make test-e2e`: two workers, `--dist load`, which hands each worker two consecutive tests
# first, then one more to whichever has one left). The two longest take 5 minutes each: each is paired with a short one
# on a worker of its own, and the rest go to whichever worker is free. Handed both long ones, one worker ran 10
# minutes while the other had ended. (Three workers were tried: the tier runs beside two others on 2 cores, and every
# test ran longer, the catalog's three times as long; the tier took 8.9 minutes, not 8.5.)
E2E_ORDER = (
    "test_the_drills_fire_their_alerts_on_a_real_prometheus_and_lose_nothing",  # about 320 s
    "test_daemon_sensor_brings_every_committed_event_exactly_once_despite_a_killed_run",  # 55 s
    "test_a_new_project_follows_the_quickstart_to_typed_tables_and_a_cross_stream_projection",  # 280 s
    "test_the_daemon_keeps_the_shops_tables_equal_to_an_emmett_store_its_client_writes",  # 80 s
    "test_a_hung_run_is_stopped_at_the_maximum_runtime_and_its_range_goes_on",  # 60-115 s
    "test_every_table_by_name_through_the_catalog_a_new_session_and_the_sql_endpoint_kept_equal_to_the_lake",  # 100 s
    "test_tailing_runs_report_their_passes_and_a_run_killed_mid_batch_loses_and_repeats_nothing",  # 85 s
)


@pytest.fixture
def emmett_app(dsn: StoreDsn) -> Iterator[str]:
    """The application's own login: it may create tables in `public` (Emmett makes its schema on first use)."""
    login = f"t_emmett_app_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_login(conn, login)
        conn.execute(sql.SQL("GRANT USAGE, CREATE ON SCHEMA public TO {}").format(sql.Identifier(login)))
    yield make_conninfo(dsn, user=login)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(login)))
        conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(login)))
