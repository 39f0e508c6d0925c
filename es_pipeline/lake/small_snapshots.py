"""Snapshots without a JVM: pyarrow finds the streams due, delta-rs appends them, psycopg writes them back.

The `snapshots` schedule runs every ten minutes; on the Spark path each run was a Spark Connect session,
four jobs and an append, most of the steady-state cost of the JVM. Up to `SMALL_SNAPSHOTS` streams the
same work is done here, with the same rules as `lake/snapshots.py`'s Spark path:
- a stream is due when it has no snapshot and `threshold` events, has `threshold` events more than its
  latest snapshot (the highest version, then revision), or its reducer revision changed;
- the append carries the Delta transaction (`es_pipeline.snapshots`, the `stream_state` version read),
  so a replay of the same state version appends nothing, whichever engine committed the first;
- it happens under the table's lock in the store (`serial.one_at_a_time`, "snapshots"), as Spark's append
  and maintenance do: one committer at a time (docs/decisions.md, "One committer engine per table").
`take_small` returns None where it does not apply (more streams, deletion vectors), and the caller runs
the Spark path.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from es_pipeline.lake import tables
from es_pipeline.lake.arrow_append import append_batches
from es_pipeline.lake.serial import one_at_a_time
from es_pipeline.lake.small_increments import _files, _row_count
from es_pipeline.lake.tables import Location
from es_pipeline.store.event_store import EventStore, Snapshot

SMALL_SNAPSHOTS = 200_000  # streams in stream_state at most; above, Spark takes the snapshots
SMALL_SNAPSHOT_ROWS = 2_000_000  # snapshots in the lake at most (they are read whole)
APP_ID = "es_pipeline.snapshots"
_COLUMNS = ["stream_id", "stream_type", "version", "state", "revision", "tenant"]  # read from state and snapshots
_KEY = ["tenant", "stream_id"]
SCHEMA = pa.schema([
    pa.field("stream_id", pa.string()), pa.field("stream_type", pa.string()), pa.field("version", pa.int32()),
    pa.field("state", pa.string()), pa.field("revision", pa.int32()), pa.field("taken_at", pa.timestamp("us", tz="UTC")),
    pa.field("tenant", pa.string()),  # last: where a table made before tenants takes it
])


def take_small(warehouse: Location, store: EventStore, threshold: int) -> tuple[int, int, int] | None:
    """(taken, written back, stream_state version) of a snapshot run done here; None: Spark's to do."""
    state_path = tables.table_path(warehouse, "stream_state")
    snap_path = tables.table_path(warehouse, "snapshots")
    tables.ensure_table_arrow(snap_path, SCHEMA, comment="es_pipeline: snapshots taken per stream and version")
    snap = DeltaTable(snap_path)
    if _has_deletion_vectors(snap) or _row_count(snap) > SMALL_SNAPSHOT_ROWS or not tables.has_columns(snap, _KEY):
        return None  # (a table made before tenants: Spark adds the column)
    # The whole take, the write-back included, in the table's turn, reading `stream_state` once the turn is ours:
    # `tenant erase` deletes a tenant's snapshots (lake and store) in the same turn, after its `stream_state` rows.
    with one_at_a_time(store.dsn, "snapshots") as turn:
        if not tables.is_delta_table(state_path):  # nothing folded yet: only a write-back to redo, if any
            return 0, _write_back(latest(_files(snap_path, DeltaTable(snap_path)).to_table(columns=_COLUMNS)), store), -1
        state = DeltaTable(state_path)
        if _has_deletion_vectors(state) or _row_count(state) > SMALL_SNAPSHOTS or not tables.has_columns(state, _KEY):
            return None
        state_version = state.version()
        snap = DeltaTable(snap_path)  # the version this turn reads, from which it commits
        read = snap.transaction_version(APP_ID)
        lake = _files(snap_path, snap).to_table(columns=_COLUMNS)
        due = _due(_files(state_path, state).to_table(columns=_COLUMNS), latest(lake), threshold)
        taken = append_batches(due.to_batches(), SCHEMA, snap_path, app_id=APP_ID, version=state_version, table=snap,
                               before_commit=lambda: turn.confirm(snap_path, APP_ID, None if read is None else int(read)))
        if taken:  # the lake is the record: what it now holds, these included
            lake = pa.concat_tables([lake, due.select(_COLUMNS)])
        elif taken is None:  # this state version was taken already (a replay): read what is there
            lake = _files(snap_path, DeltaTable(snap_path)).to_table(columns=_COLUMNS)
        return taken or 0, _write_back(latest(lake), store), state_version


def not_in_store_small(warehouse: Location, store: EventStore) -> pa.Table | None:
    """The latest snapshot of each stream in the lake where the store holds another or none (stream_id,
    version, ...); None: too many to read here (the Spark path's `not_in_store` answers)."""
    snap_path = tables.table_path(warehouse, "snapshots")
    if not tables.is_delta_table(snap_path):
        return pa.table({c: pa.array([], SCHEMA.field(c).type) for c in _COLUMNS})
    snap = DeltaTable(snap_path)
    if _has_deletion_vectors(snap) or _row_count(snap) > SMALL_SNAPSHOT_ROWS or not tables.has_columns(snap, _KEY):
        return None
    return _missing(latest(_files(snap_path, snap).to_table(columns=_COLUMNS)), store)


def latest(snapshots: pa.Table) -> pa.Table:
    """Each stream's latest snapshot: the highest version, then revision (Spark's `max(struct(version, revision))`)."""
    if snapshots.num_rows < 2:
        return snapshots
    s = snapshots.sort_by([("tenant", "ascending"), ("stream_id", "ascending"), ("version", "descending"),
                           ("revision", "descending")])
    ids, tenants = s["stream_id"].combine_chunks(), s["tenant"].combine_chunks()
    n = len(ids)
    changed = pc.or_(pc.not_equal(ids.slice(1), ids.slice(0, n - 1)), pc.not_equal(tenants.slice(1), tenants.slice(0, n - 1)))
    return s.filter(pa.concat_arrays([pa.array([True]), changed]))


def _due(state: pa.Table, last: pa.Table, threshold: int) -> pa.Table:
    """The rows of `state` to snapshot now, with their `taken_at`, in the table's schema."""
    last = last.select([*_KEY, "version", "revision"]).rename_columns([*_KEY, "last_version", "last_revision"])
    j = state.join(last, keys=_KEY, join_type="left outer")
    version, last_version = j["version"], j["last_version"]
    grown = pc.and_kleene(pc.is_null(last_version), pc.greater_equal(version, threshold))
    grown = pc.or_kleene(grown, pc.greater_equal(pc.subtract(version, last_version), threshold))
    revised = pc.not_equal(j["last_revision"], j["revision"])
    # A stream without state (its type has no reducer) has nothing to snapshot; null: not due (as Spark).
    due = j.filter(pc.and_kleene(pc.and_kleene(pc.greater(version, 0), pc.is_valid(j["state"])), pc.or_kleene(grown, revised)))
    taken_at = pa.array([datetime.now(UTC)] * due.num_rows, SCHEMA.field("taken_at").type)
    return due.select(_COLUMNS[:-1]).append_column("taken_at", taken_at).append_column("tenant", due["tenant"]).cast(SCHEMA)


def _missing(latest_rows: pa.Table, store: EventStore) -> pa.Table:
    held = {(t, s): (v, r) for t, s, v, r in store.snapshot_keys()}
    keep = [held.get((t, s)) != (v, r) for t, s, v, r in zip(
        latest_rows["tenant"].to_pylist(), latest_rows["stream_id"].to_pylist(), latest_rows["version"].to_pylist(),
        latest_rows["revision"].to_pylist(), strict=True)]
    return latest_rows.filter(pa.array(keep, pa.bool_()))


def _write_back(latest_rows: pa.Table, store: EventStore) -> int:
    if not store.has_snapshots_table():  # a store not migrated (or adopted) since: the check says so
        return 0
    missing = _missing(latest_rows, store)
    return store.write_snapshots(
        Snapshot(r["stream_id"], r["stream_type"], r["version"], json.loads(r["state"]), r["revision"], r["tenant"])
        for r in missing.to_pylist()
    )


def _has_deletion_vectors(table: DeltaTable) -> bool:
    return "deletionVectors" in (table.protocol().writer_features or [])

