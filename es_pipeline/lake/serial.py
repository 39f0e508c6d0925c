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
from contextlib import contextmanager

from es_pipeline.store.conninfo import lock_transaction

_NAMESPACE = zlib.crc32(b"es_pipeline:lake-tables") & 0x7FFFFFFF


@contextmanager
def one_at_a_time(store_dsn: str | None, table: str) -> Iterator[None]:
    """Run the block while holding the lock of `table` in the store at `store_dsn` (none when it is None)."""
    if store_dsn is None:
        yield
        return
    with lock_transaction(store_dsn, application_name=f"es_pipeline update {table}"[:63]) as conn:
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (_NAMESPACE, zlib.crc32(table.encode()) & 0x7FFFFFFF))
        yield
        conn.rollback()  # releases the lock
