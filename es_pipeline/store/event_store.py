"""The writers' side of the event store: append with an expected version, read, load.

Knows nothing of Dagster or Spark. Every identifier goes through `sql.Identifier`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from es_pipeline.errors import ConcurrencyError, InvalidAppend, UnknownTenant
from es_pipeline.source.mapping import Source
from es_pipeline.store.conninfo import connect
from es_pipeline.store.migrations import has_tenants

MAX_STREAM_ID_LENGTH = 200
NO_STREAM = 0  # expected version of a stream that does not exist yet


@dataclass(frozen=True)
class NewEvent:
    event_type: str
    payload: Mapping[str, Any]
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RecordedEvent:
    stream_id: str
    stream_type: str
    version: int
    event_type: str
    payload: dict[str, Any]
    metadata: dict[str, Any]
    tx_id: int
    global_position: int
    slice: int
    recorded_at: datetime


@dataclass(frozen=True)
class Snapshot:
    stream_id: str
    stream_type: str
    version: int
    state: dict[str, Any]
    revision: int
    tenant: str = ""  # '' in a store without tenants


State = dict[str, Any]
Fold = Callable[[State, RecordedEvent], State]

_EVENT_COLUMNS = (
    "stream_id, stream_type, version, event_type, payload, metadata, tx_id, global_position, slice, recorded_at"
)


_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")  # an escaped NUL, not an escaped backslash before "u0000"


def _encode(stream_id: str, what: str, value: Mapping[str, Any]) -> str:
    if not isinstance(value, Mapping):
        raise InvalidAppend(stream_id, f"the {what} must be a JSON object (a dict), got {type(value).__name__}")
    try:
        text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidAppend(stream_id, f"the {what} is not JSON-serialisable ({exc})") from None
    if _JSON_NUL.search(text):
        raise InvalidAppend(stream_id, f"the {what} holds a NUL character (\\u0000), which jsonb cannot store")
    return text


def _validate(stream_id: str, stream_type: str, events: Sequence[NewEvent], expected_version: int) -> None:
    if not isinstance(stream_id, str) or not stream_id:
        raise InvalidAppend(str(stream_id), "the stream id must be a non-empty string")
    if len(stream_id) > MAX_STREAM_ID_LENGTH:
        raise InvalidAppend(
            stream_id[:40] + "…", f"the stream id has {len(stream_id)} characters, at most {MAX_STREAM_ID_LENGTH} allowed"
        )
    if not stream_type:
        raise InvalidAppend(stream_id, "the stream type must be a non-empty string")
    names = [("stream id", stream_id), ("stream type", stream_type), *(("event type", e.event_type) for e in events)]
    for name, text in names:
        if "\x00" in text:
            raise InvalidAppend(stream_id.replace("\x00", "\\x00"), f"the {name} holds a NUL character, which text cannot store")
    if not events:
        raise InvalidAppend(stream_id, "the list of events is empty; append at least one event")
    if expected_version < 0:
        raise InvalidAppend(stream_id, f"expected version {expected_version} is negative")
    for e in events:
        if not e.event_type:
            raise InvalidAppend(stream_id, "an event has an empty event_type")


def _tenant_condition(tenant: str) -> sql.SQL:
    """`tenant = %(tenant)s AND ` in a store partitioned by tenant (a tenant named), else nothing."""
    return sql.SQL("tenant = %(tenant)s AND " if tenant else "")


class EventStore:
    """Append to and read from the event store in `schema` (default `es`)."""

    def __init__(self, dsn: str, schema: str = "es", *, snapshots_of: str = "") -> None:
        """`snapshots_of`: the consumer of an adopted framework's store, whose snapshots are written back to
        es_pipeline's own `es_pipeline.snapshots` (its rows apart), not to `<schema>.snapshots`."""
        self.dsn = dsn
        self.schema = schema
        self._s = sql.Identifier(schema)
        self._tenants: bool | None = None  # whether `events` is partitioned by tenant: read on first use
        self.snapshots_of = snapshots_of
        self.snapshots_table = sql.Identifier("es_pipeline" if snapshots_of else schema, "snapshots")
        # The rows of this store in the snapshots table, as a condition and as the values of an insert.
        self._mine = sql.SQL("consumer = %(consumer)s AND " if snapshots_of else "")

    @classmethod
    def for_source(cls, dsn: str, source: Source) -> EventStore:
        """The store that `source` is read from, its snapshots written back where they belong: the native store's
        `<schema>.snapshots`, or, for an adopted store, its own rows of `es_pipeline.snapshots`."""
        return cls(dsn, source.schema, snapshots_of="" if source.native else source.consumer)

    def partitioned_by_tenant(self, conn: psycopg.Connection | None = None) -> bool:
        """Whether this store was created partitioned by tenant (`ES_PIPELINE_SOURCE=es-tenants`)."""
        if self._tenants is None:
            if conn is None:
                with self.connect() as own:
                    self._tenants = bool(has_tenants(own, self.schema))
            else:
                self._tenants = bool(has_tenants(conn, self.schema))
        return self._tenants

    def connect(self) -> psycopg.Connection:
        return connect(self.dsn)

    # -- writing ---------------------------------------------------------------------------------

    def append(
        self,
        stream_id: str,
        stream_type: str,
        events: Sequence[NewEvent],
        expected_version: int,
        *,
        conn: psycopg.Connection | None = None,
        tenant: str = "",
    ) -> int:
        """Append `events` to a stream atomically; return the stream's new version.

        `expected_version` is the version the caller last saw (0 for a new stream). A mismatch raises
        `ConcurrencyError` and writes nothing. With `conn`, the append joins the caller's transaction
        (several streams can then commit together); without, it commits on its own. `tenant`: the stream's
        tenant in a store partitioned by tenant (required there, refused elsewhere).
        """
        _validate(stream_id, stream_type, events, expected_version)
        payloads = [_encode(stream_id, "payload", e.payload) for e in events]
        metadatas = [_encode(stream_id, "metadata", e.metadata) for e in events]
        if conn is None:
            with self.connect() as own, own.transaction():
                self._check_tenant(own, stream_id, tenant)
                return self._append(own, stream_id, stream_type, events, expected_version, payloads, metadatas, tenant)
        # In the caller's transaction: the version check comes first, so a conflict raises
        # before anything is written, and the caller's transaction decides commit or rollback.
        self._check_tenant(conn, stream_id, tenant)
        return self._append(conn, stream_id, stream_type, events, expected_version, payloads, metadatas, tenant)

    def _check_tenant(self, conn: psycopg.Connection, stream_id: str, tenant: str, *, reading: bool = False) -> None:
        """A tenant named exactly where the store has tenants (else appends and reads would mix or miss streams)."""
        partitioned = self.partitioned_by_tenant(conn)
        if partitioned == bool(tenant):
            return
        reason = (f"{self.schema}.events is partitioned by tenant: pass the stream's tenant" if partitioned else
                  f"{self.schema}.events has no tenants (created without ES_PIPELINE_SOURCE=es-tenants): pass no tenant")
        if reading:
            raise ValueError(f"cannot read stream {stream_id!r}: {reason}")
        raise InvalidAppend(stream_id, reason)

    def _append(
        self,
        conn: psycopg.Connection,
        stream_id: str,
        stream_type: str,
        events: Sequence[NewEvent],
        expected_version: int,
        payloads: list[str],
        metadatas: list[str],
        tenant: str = "",
    ) -> int:
        new_version = expected_version + len(events)
        # In a store partitioned by tenant, the tenant is one more column of both tables and of both keys.
        t_col, t_val = (sql.SQL("tenant, "), sql.SQL("%(tenant)s, ")) if tenant else (sql.SQL(""), sql.SQL(""))
        t_key = _tenant_condition(tenant)
        if expected_version == NO_STREAM:
            claim = sql.SQL(
                "INSERT INTO {s}.streams ({tc}stream_id, stream_type, version) VALUES ({tv}%(id)s, %(type)s, %(new)s) "
                "ON CONFLICT ({tc}stream_id) DO NOTHING RETURNING version"
            )
        else:
            claim = sql.SQL(
                "UPDATE {s}.streams SET version = %(new)s, updated_at = now() "
                "WHERE {tk}stream_id = %(id)s AND version = %(expected)s RETURNING version"
            )
        # One round trip: claim the version range, then insert only if the claim succeeded.
        query = sql.SQL(
            "WITH claim AS ({claim}) "
            "INSERT INTO {s}.events ({tc}stream_id, stream_type, version, event_type, payload, metadata) "
            "SELECT {tv}%(id)s, %(type)s, u.version, u.event_type, u.payload, u.metadata "
            "FROM unnest(%(versions)s::int[], %(types)s::text[], %(payloads)s::jsonb[], %(metadatas)s::jsonb[]) "
            "AS u(version, event_type, payload, metadata) WHERE EXISTS (SELECT 1 FROM claim)"
        ).format(claim=claim.format(s=self._s, tc=t_col, tv=t_val, tk=t_key), s=self._s, tc=t_col, tv=t_val)
        try:
            cur = conn.execute(query, self._append_params(stream_id, stream_type, events, expected_version,
                                                          new_version, payloads, metadatas, tenant))
        except psycopg.errors.CheckViolation as exc:
            if tenant and "no partition of relation" in str(exc):
                raise UnknownTenant(tenant, f"{self.schema}.events") from None
            raise
        if cur.rowcount == 0:
            actual = conn.execute(
                sql.SQL("SELECT version FROM {}.streams WHERE {}stream_id = %(id)s").format(self._s, t_key),
                {"id": stream_id, "tenant": tenant},
            ).fetchone()
            if tenant and actual is None and not self._has_partition(conn, tenant):
                raise UnknownTenant(tenant, f"{self.schema}.events")  # erased: its streams went with it
            raise ConcurrencyError(stream_id, expected_version, actual[0] if actual else NO_STREAM)
        return new_version

    def _has_partition(self, conn: psycopg.Connection, tenant: str) -> bool:
        row = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass(%s) AND pg_get_expr(c.relpartbound, c.oid) = format('FOR VALUES IN (%%L)', %s::text))",
            (sql.Identifier(self.schema, "events").as_string(conn), tenant),
        ).fetchone()
        return bool(row and row[0])

    @staticmethod
    def _append_params(
        stream_id: str, stream_type: str, events: Sequence[NewEvent], expected_version: int, new_version: int,
        payloads: list[str], metadatas: list[str], tenant: str,
    ) -> dict[str, Any]:
        return {
                "tenant": tenant,
                "id": stream_id,
                "type": stream_type,
                "new": new_version,
                "expected": expected_version,
                "versions": list(range(expected_version + 1, new_version + 1)),
                "types": [e.event_type for e in events],
                "payloads": payloads,
                "metadatas": metadatas,
        }

    # -- reading ---------------------------------------------------------------------------------

    def read_stream(
        self, stream_id: str, *, after_version: int = 0, conn: psycopg.Connection | None = None, tenant: str = ""
    ) -> list[RecordedEvent]:
        """A stream's events after `after_version`, in order; `tenant`: the stream's, in a store partitioned by tenant."""
        query = sql.SQL(
            "SELECT " + _EVENT_COLUMNS + " FROM {}.events WHERE {}stream_id = %(id)s AND version > %(after)s ORDER BY version"
        ).format(self._s, _tenant_condition(tenant))
        params = {"id": stream_id, "after": after_version, "tenant": tenant}
        if conn is None:
            with self.connect() as own:
                self._check_tenant(own, stream_id, tenant, reading=True)
                rows = own.execute(query, params).fetchall()
        else:
            self._check_tenant(conn, stream_id, tenant, reading=True)
            rows = conn.execute(query, params).fetchall()
        return [RecordedEvent(*r) for r in rows]

    def stream_version(self, stream_id: str, *, tenant: str = "") -> int:
        with self.connect() as conn:
            self._check_tenant(conn, stream_id, tenant, reading=True)
            row = conn.execute(
                sql.SQL("SELECT version FROM {}.streams WHERE {}stream_id = %(id)s").format(self._s, _tenant_condition(tenant)),
                {"id": stream_id, "tenant": tenant},
            ).fetchone()
        return row[0] if row else NO_STREAM

    def slice_of(self, stream_id: str) -> int:
        """The slice of a stream, computed by the database's own function (the one definition)."""
        with self.connect() as conn:
            row = conn.execute(sql.SQL("SELECT {}.slice_of(%s)").format(self._s), (stream_id,)).fetchone()
        assert row is not None
        return int(row[0])

    def read_snapshot(
        self, stream_id: str, conn: psycopg.Connection | None = None, *, tenant: str = ""
    ) -> Snapshot | None:
        query = sql.SQL(
            "SELECT stream_id, stream_type, version, state, revision, tenant FROM {} "
            "WHERE {}tenant = %(tenant)s AND stream_id = %(id)s"
        ).format(self.snapshots_table, self._mine)
        params = {"tenant": tenant, "id": stream_id, "consumer": self.snapshots_of}
        if conn is None:
            with self.connect() as own:
                row = own.execute(query, params).fetchone()
        else:
            row = conn.execute(query, params).fetchone()
        return Snapshot(*row) if row else None

    def has_snapshots_table(self) -> bool:
        """Whether the snapshots table is there (`<schema>.snapshots`, or `es_pipeline.snapshots` for an adopted
        store: made by `source adopt`; a store adopted by an older release has none until adopted again)."""
        with self.connect() as conn:
            row = conn.execute("SELECT to_regclass(%s)", (self.snapshots_table.as_string(conn),)).fetchone()
        return row is not None and row[0] is not None

    def snapshot_keys(self) -> list[tuple[str, str, int, int]]:
        """(tenant, stream_id, version, revision) of every snapshot the store holds."""
        with self.connect() as conn:
            rows = conn.execute(
                sql.SQL("SELECT tenant, stream_id, version, revision FROM {} WHERE {}true").format(
                    self.snapshots_table, self._mine), {"consumer": self.snapshots_of},
            ).fetchall()
        return [(str(t), str(s), int(v), int(r)) for t, s, v, r in rows]

    def load(
        self, stream_id: str, fold: Fold, *, revision: int, initial: State | None = None, tenant: str = ""
    ) -> tuple[State, int]:
        """State of a stream = its snapshot (if taken by this `revision`) + the events after it.

        Returns (state, version). Read in one repeatable-read transaction so that the snapshot and
        the events agree even while writers append.
        """
        with self.connect() as conn:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            with conn.transaction():
                snap = self.read_snapshot(stream_id, conn, tenant=tenant)
                if snap is not None and snap.revision == revision:
                    state, version = dict(snap.state), snap.version
                else:
                    state, version = dict(initial or {}), 0
                for event in self.read_stream(stream_id, after_version=version, conn=conn, tenant=tenant):
                    state = fold(state, event)
                    version = event.version
        return state, version

    def delete_snapshots(self, tenant: str, conn: psycopg.Connection) -> int:
        """Delete every snapshot of `tenant` (`tenant erase`), in the caller's transaction; the rows deleted."""
        if not self.has_snapshots_table():
            return 0
        cur = conn.execute(sql.SQL("DELETE FROM {} WHERE {}tenant = %(tenant)s").format(self.snapshots_table, self._mine),
                           {"consumer": self.snapshots_of, "tenant": tenant})
        return cur.rowcount

    def write_snapshots(self, snapshots: Iterable[Snapshot], conn: psycopg.Connection | None = None) -> int:
        """Upsert snapshots; an older version never overwrites a newer one of the same revision."""
        rows = [
            {"consumer": self.snapshots_of, "tenant": s.tenant, "id": s.stream_id, "type": s.stream_type,
             "version": s.version, "state": json.dumps(s.state), "revision": s.revision}
            for s in snapshots
        ]
        if not rows:
            return 0
        consumer = sql.SQL("consumer, " if self.snapshots_of else "")
        query = sql.SQL(
            "INSERT INTO {table} AS t ({c}tenant, stream_id, stream_type, version, state, revision) "
            "VALUES ({cv}%(tenant)s, %(id)s, %(type)s, %(version)s, %(state)s::jsonb, %(revision)s) "
            "ON CONFLICT ({c}tenant, stream_id) DO UPDATE SET stream_type = excluded.stream_type, "
            "version = excluded.version, state = excluded.state, revision = excluded.revision, taken_at = now() "
            "WHERE excluded.revision <> t.revision OR excluded.version > t.version"
        ).format(table=self.snapshots_table, c=consumer,
                 cv=sql.SQL("%(consumer)s, " if self.snapshots_of else ""))
        if conn is None:
            with self.connect() as own, own.transaction(), own.cursor() as cur:
                cur.executemany(query, rows)
        else:
            with conn.cursor() as cur:
                cur.executemany(query, rows)
        return len(rows)
