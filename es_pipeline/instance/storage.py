"""Dagster's storage on Postgres, each process keeping a few connections open instead of one per statement.

dagster-postgres opens a new connection for every statement, except in the webserver (SQLAlchemy's
`NullPool`). Under `make dev`'s loop that was 21 new connections a second to Dagster's database, each a
server process forked and a password exchange (SCRAM) on both ends: the largest part of the daemon's
and of Postgres's CPU at steady state (docs/decisions.md, "Tailing runs"). This is dagster-postgres's
storage (same tables, same configuration) with its three engines pooled: `POOL_SIZE` connections kept per
engine and process, more opened when threads need them at once, checked before use once idle for
`PING_AFTER_IDLE_SECONDS` (a server restart or an idle timeout costs a reconnect, never a failed
statement) and renewed every hour. The engines belong to the process, not to one instance: the code
server builds an instance for every sensor tick, and each would otherwise open its connections and check
the tables again. They close when the process exits.

`dagster.yaml` names it (`storage: custom:`). Run processes are forks of a worker that has no instance
(es_pipeline/instance/launcher.py): each builds its own after the fork, so no pooled connection is ever
shared between processes.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import sqlalchemy
import sqlalchemy.exc
import sqlalchemy.pool as db_pool
from dagster._serdes import ConfigurableClassData
from dagster_postgres import DagsterPostgresStorage
from dagster_postgres.event_log import PostgresEventLogStorage
from dagster_postgres.run_storage import PostgresRunStorage
from dagster_postgres.schedule_storage import PostgresScheduleStorage
from dagster_postgres.utils import create_pg_engine, get_token_provider_from_config, pg_url_from_config

POOL_SIZE = 3  # connections kept open per engine (run, event log, schedule storage) and process
POOL_RECYCLE_SECONDS = 3600
PING_AFTER_IDLE_SECONDS = 10.0  # a connection idle this long is checked before use; a busy one is not

# One engine per process, database and storage, shared by every instance the process builds: the code
# server builds an instance for every sensor tick, which would otherwise open new connections (and check
# the tables) each time. A forked process builds its own (keyed by pid).
_ENGINES: dict[tuple[int, str, str], sqlalchemy.engine.Engine] = {}
_LOCK = threading.Lock()


def _engine(kind: str, postgres_url: str, token_provider: Any) -> tuple[sqlalchemy.engine.Engine, bool]:
    """The process's pooled engine for this storage and database, and whether it was made just now."""
    key = (os.getpid(), kind, postgres_url)
    with _LOCK:
        if key in _ENGINES:
            return _ENGINES[key], False
        engine = create_pg_engine(
            postgres_url, token_provider, isolation_level="AUTOCOMMIT", poolclass=db_pool.QueuePool,
            pool_size=POOL_SIZE, max_overflow=16, pool_recycle=POOL_RECYCLE_SECONDS)
        sqlalchemy.event.listen(engine, "checkin", _checked_in)
        sqlalchemy.event.listen(engine, "checkout", _check_if_idle)
        _ENGINES[key] = engine
        return engine, True


def _checked_in(dbapi_connection: Any, record: Any) -> None:
    record.info["idle_since"] = time.monotonic()


def _check_if_idle(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    """A connection idle for a while is checked before use (the server may have closed it: a restart, an
    idle timeout); the pool then replaces it, where the statement would fail. SQLAlchemy's `pool_pre_ping`
    would check before every statement: a round trip each."""
    if time.monotonic() - record.info.get("idle_since", 0.0) < PING_AFTER_IDLE_SECONDS:
        return
    try:
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # noqa: BLE001 - any failure: a connection not to be used
        raise sqlalchemy.exc.DisconnectionError(str(exc)) from exc


def _pool(part: Any, kind: str, postgres_url: str, token_provider: Any) -> None:
    """Give one of dagster-postgres's storages the process's pooled engine in place of its `NullPool` one."""
    unpooled = part._engine
    part._engine, _ = _engine(kind, postgres_url, token_provider)
    unpooled.dispose()


def _checked(kind: str, postgres_url: str) -> bool:
    """Whether this process has already built this storage on this database (its tables checked then)."""
    return (os.getpid(), kind, postgres_url) in _ENGINES


class _PooledRunStorage(PostgresRunStorage):
    def __init__(self, postgres_url: str, should_autocreate_tables: bool, token_provider: Any) -> None:
        super().__init__(postgres_url, should_autocreate_tables and not _checked("runs", postgres_url),
                         token_provider=token_provider)
        self.should_autocreate_tables = should_autocreate_tables
        _pool(self, "runs", postgres_url, token_provider)


class _PooledEventLogStorage(PostgresEventLogStorage):
    def __init__(self, postgres_url: str, should_autocreate_tables: bool, token_provider: Any) -> None:
        super().__init__(postgres_url, should_autocreate_tables and not _checked("event_log", postgres_url),
                         token_provider=token_provider)
        self.should_autocreate_tables = should_autocreate_tables
        _pool(self, "event_log", postgres_url, token_provider)


class _PooledScheduleStorage(PostgresScheduleStorage):
    def __init__(self, postgres_url: str, should_autocreate_tables: bool, token_provider: Any) -> None:
        super().__init__(postgres_url, should_autocreate_tables and not _checked("schedules", postgres_url),
                         token_provider=token_provider)
        self.should_autocreate_tables = should_autocreate_tables
        _pool(self, "schedules", postgres_url, token_provider)


def close_engines() -> None:
    """Close this process's pooled connections (at exit, and in tests)."""
    with _LOCK:
        for key in [k for k in _ENGINES if k[0] == os.getpid()]:
            _ENGINES.pop(key).dispose()


atexit.register(close_engines)


class PooledPostgresStorage(DagsterPostgresStorage):
    """`DagsterPostgresStorage` whose storages keep their connections (see the module), for every instance
    the process builds, until it exits."""

    def __init__(self, postgres_url: str, should_autocreate_tables: bool = True,
                 inst_data: ConfigurableClassData | None = None, token_provider: Any = None) -> None:
        # DagsterPostgresStorage.__init__ would build the unpooled three first: set its fields here instead.
        self.postgres_url = postgres_url
        self.should_autocreate_tables = should_autocreate_tables
        self._inst_data = inst_data
        self._run_storage = _PooledRunStorage(postgres_url, should_autocreate_tables, token_provider)
        self._event_log_storage = _PooledEventLogStorage(postgres_url, should_autocreate_tables, token_provider)
        self._schedule_storage = _PooledScheduleStorage(postgres_url, should_autocreate_tables, token_provider)
        super(DagsterPostgresStorage, self).__init__()  # what DagsterPostgresStorage.__init__ ends with

    @classmethod
    def from_config_value(  # type: ignore[override]
        cls, inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]
    ) -> PooledPostgresStorage:
        return cls(
            inst_data=inst_data, postgres_url=pg_url_from_config(config_value),
            should_autocreate_tables=config_value.get("should_autocreate_tables", True),
            token_provider=get_token_provider_from_config(config_value),
        )
