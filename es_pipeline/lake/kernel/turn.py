"""One update of a lake table at a time, across processes and hosts, by a lock in the event store.

Two overlapping updates of an incremental projection could each read the same previous version and
merge overlapping increments: counted twice. The lock is a transaction-level advisory lock in the
event store (the one place every es_pipeline process shares), held by a transaction open for the
update: like the slice locks, it stays with its server connection behind a transaction pooler and
holds back neither the horizon nor vacuum. A second update waits, then finds less or nothing to do.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import psycopg

from es_pipeline.errors import UpdateOverlapped
from es_pipeline.lake.delta import tables
from es_pipeline.store.conninfo import lock_transaction

_NAMESPACE = zlib.crc32(b"es_pipeline:lake-tables") & 0x7FFFFFFF


@dataclass
class Turn:
    """One update's turn at a table: `confirm` it just before the commit."""

    table: str
    conn: psycopg.Connection | None = None  # the lock's transaction; None without a store
    key: int = 0

    def confirm(self, path: str, app_id: str, read: int | None) -> None:
        """`UpdateOverlapped` unless the lock is still held and the table's txn version of `app_id` is
        still `read`, the one this update started from (another writer's commit would be counted twice)."""
        if self.conn is not None:
            try:
                row = self.conn.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() "
                    "AND classid = %s::oid AND objid = %s::oid AND objsubid = 2 AND granted", (_NAMESPACE, self.key),
                ).fetchone()
            except psycopg.Error:
                row = None
            if row != (1,):
                raise UpdateOverlapped(self.table, "its lock in the event store is no longer held (its connection ended)")
        now = tables.transaction_version(path, app_id)
        if now != read:
            raise UpdateOverlapped(self.table, f"another update committed meanwhile (version {now}, this one read {read})")


@contextmanager
def one_at_a_time(store_dsn: str | None, table: str) -> Iterator[Turn]:
    """Run the block while holding the lock of `table` in the store at `store_dsn` (none when it is None)."""
    with _turn(store_dsn, table, wait=True) as turn:
        assert turn is not None
        yield turn


@contextmanager
def turn_if_free(store: str | psycopg.Connection, table: str) -> Iterator[Turn | None]:
    """The turn at `table` if no other update holds it now, else None (for work that must not wait).

    `store`: the store's DSN (a connection for this turn alone), or a `lock_transaction` connection the
    caller keeps for turn after turn (a tailing run's); the turn ends its transaction either way."""
    with _turn(store, table, wait=False) as turn:
        yield turn


@contextmanager
def _turn(store: str | psycopg.Connection | None, table: str, *, wait: bool) -> Iterator[Turn | None]:
    if store is None:
        yield Turn(table)
        return
    key = zlib.crc32(table.encode()) & 0x7FFFFFFF
    opened: AbstractContextManager[psycopg.Connection] = (
        nullcontext(store) if isinstance(store, psycopg.Connection)
        else lock_transaction(store, application_name=f"es_pipeline update {table}"[:63]))
    with opened as conn:
        try:
            if wait:
                conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (_NAMESPACE, key))
            else:
                row = conn.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", (_NAMESPACE, key)).fetchone()
                if row != (True,):
                    yield None
                    return
            yield Turn(table, conn, key)
        finally:
            if not conn.closed:  # a connection that ended took its lock with it
                conn.rollback()  # releases the lock
