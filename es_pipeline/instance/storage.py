"""Dagster's storage on Postgres, each process keeping a few connections open instead of one per statement.

dagster-postgres opens a new connection for every statement, except in the webserver (SQLAlchemy's
`NullPool`). Under `make dev`'s loop that was 21 new connections a second to Dagster's database, each a
server process forked and a password exchange (SCRAM) on both ends: the largest part of the daemon's
and of Postgres's CPU at steady state (docs/decisions.md, "Tailing runs"). This is dagster-postgres's
storage (same tables, same configuration) with its three engines pooled: `POOL_SIZE` connections kept per
engine and process, more opened when threads need them at once, each checked before use (a server
restart or an idle timeout costs a reconnect, never a failed statement) and renewed every hour.

`dagster.yaml` names it (`storage: custom:`). Run processes are forks of a worker that has no instance
(es_pipeline/instance/launcher.py): each builds its own after the fork, so no pooled connection is ever
shared between processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy.pool as db_pool
from dagster._serdes import ConfigurableClassData
from dagster_postgres import DagsterPostgresStorage
from dagster_postgres.event_log import PostgresEventLogStorage
from dagster_postgres.run_storage import PostgresRunStorage
from dagster_postgres.schedule_storage import PostgresScheduleStorage
from dagster_postgres.utils import create_pg_engine, get_token_provider_from_config, pg_url_from_config

POOL_SIZE = 3  # connections kept open per engine (run, event log, schedule storage) and process
POOL_RECYCLE_SECONDS = 3600


def _pool(part: Any, postgres_url: str, token_provider: Any) -> None:
    """Give one of dagster-postgres's storages a pooled engine in place of its `NullPool` one."""
    unpooled = part._engine
    part._engine = create_pg_engine(
        postgres_url, token_provider, isolation_level="AUTOCOMMIT", poolclass=db_pool.QueuePool,
        pool_size=POOL_SIZE, max_overflow=16, pool_pre_ping=True, pool_recycle=POOL_RECYCLE_SECONDS)
    unpooled.dispose()


class _PooledRunStorage(PostgresRunStorage):
    def __init__(self, postgres_url: str, should_autocreate_tables: bool, token_provider: Any) -> None:
        super().__init__(postgres_url, should_autocreate_tables, token_provider=token_provider)
        _pool(self, postgres_url, token_provider)

    def dispose(self) -> None:
        super().dispose()
        self._engine.dispose()


class _PooledEventLogStorage(PostgresEventLogStorage):
    def __init__(self, postgres_url: str, should_autocreate_tables: bool, token_provider: Any) -> None:
        super().__init__(postgres_url, should_autocreate_tables, token_provider=token_provider)
        _pool(self, postgres_url, token_provider)

    def dispose(self) -> None:
        super().dispose()
        self._engine.dispose()


class _PooledScheduleStorage(PostgresScheduleStorage):
    def __init__(self, postgres_url: str, should_autocreate_tables: bool, token_provider: Any) -> None:
        super().__init__(postgres_url, should_autocreate_tables, token_provider=token_provider)
        _pool(self, postgres_url, token_provider)

    def dispose(self) -> None:
        super().dispose()
        self._engine.dispose()


class PooledPostgresStorage(DagsterPostgresStorage):
    """`DagsterPostgresStorage` whose storages keep their connections (see the module); each closes them
    when its instance is disposed."""

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
