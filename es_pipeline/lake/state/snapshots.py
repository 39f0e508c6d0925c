"""`snapshots`: for streams that grew past a threshold since their last snapshot, or whose reducer revision
changed, append (stream, version, state, revision) to the Delta `snapshots` table and write it back to the
event store's `es.snapshots`, so that `load` = snapshot + later events. A stream without state (its type has
no reducer) has none.

Two paths, the same rules, the same Delta transaction id (`es_pipeline.snapshots`, the `stream_state`
version read, so a replay of the same state version appends nothing, whichever engine committed the first),
and the same lock in the store (`serial.one_at_a_time`, "snapshots": `tenant erase` deletes a tenant's
snapshots, lake and store, in that turn, after its `stream_state` rows, and none may come back):
- up to `SMALL_SNAPSHOTS` streams, without a JVM: pyarrow finds the streams due, delta-rs appends them,
  psycopg writes them back (the schedule runs every ten minutes: a Spark session each time was most of
  the steady-state cost of the JVM);
- beyond, and on tables delta-rs should not write (deletion vectors, made before tenants), Spark.
`ES_PIPELINE_ENGINE` forces either (`spark`; `local`, at any size where delta-rs may write). These bounds count
streams and snapshots, not `events`' bytes: a take reads `stream_state` and `snapshots` whole (issue 43 left
them so; docs/decisions/0041). Like every kind's, the take is Spark's past `SPARK_BYTES` of its source's files
(`stream_state`'s: the kernel's runner asks the engine rule before `build_here`).

A stream is due when it has no snapshot and `threshold` events, has `threshold` events more than its
latest snapshot, or its reducer revision changed. Its latest snapshot is the one of the highest version taken last:
after a revision is rolled back, the state of the old revision again, taken once more (not the highest revision).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from es_pipeline.lake.delta import current, tables
from es_pipeline.lake.delta.arrow_append import append_batches
from es_pipeline.lake.delta.definition import Table
from es_pipeline.lake.delta.tables import UTC_MICROS, Location
from es_pipeline.lake.kernel import runner
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.kernel.position import Position
from es_pipeline.lake.kernel.projection import Kind
from es_pipeline.lake.kernel.result import Ran, Result
from es_pipeline.lake.kernel.turn import Turn
from es_pipeline.lake.state.state_table import STREAM_STATE
from es_pipeline.store.event_store import EventStore, Snapshot

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

SNAPSHOTS = Table("snapshots", pa.schema([
    pa.field("stream_id", pa.string()), pa.field("stream_type", pa.string()), pa.field("version", pa.int32()),
    pa.field("state", pa.string()), pa.field("revision", pa.int32()), pa.field("taken_at", UTC_MICROS),
    pa.field("tenant", pa.string()),  # last: where a table made before tenants takes it
]), key=("tenant", "stream_id", "version"), comment="snapshots taken per stream and version")
def app_id(state_path: str) -> str:
    """The app id of snapshots taken from the `stream_state` table at `state_path` (its Delta id): a `stream_state`
    made anew (`lake rebuild stream_state`) starts its versions over, and must not find them taken already."""
    return SNAPSHOTS.app_id_over(tables.table_id(state_path))
KEY = ["tenant", "stream_id"]  # a stream: its latest snapshot is the highest version, then revision
DEFAULT_THRESHOLD = 50
SMALL_SNAPSHOTS = 200_000  # streams in stream_state at most; above, Spark takes the snapshots
SMALL_SNAPSHOT_ROWS = 2_000_000  # snapshots in the lake at most (they are read whole)
_COLUMNS = ["stream_id", "stream_type", "version", "state", "revision", "tenant"]  # read from state and snapshots
_TAKEN = [*_COLUMNS, "taken_at"]  # read from snapshots: which of a version's snapshots is the latest


def take_snapshots(
    engine: Engine, warehouse: Location, store: EventStore, *, threshold: int = DEFAULT_THRESHOLD,
) -> Result:
    """Append the snapshots now due to the Delta table, then write back to the store every latest
    snapshot of the lake that the store does not hold (these, and any a failed run left behind), by the kernel's
    runner in the table's turn. Its figures: `taken`, `written_back`; its version is `stream_state`'s (`over`).

    `engine`: its setting (ES_PIPELINE_ENGINE) "spark" always Spark, "local" here at any size (where delta-rs may
    write the tables), "auto" here up to `SMALL_SNAPSHOTS` streams and `SMALL_SNAPSHOT_ROWS` snapshots; without
    Spark, here at any size."""
    return runner.update(_Snapshots(store, threshold), engine, warehouse, store_dsn=store.dsn)


class _Snapshots(Kind):
    """The snapshots as a kind of the projection kernel (lake/kernel/projection.py): their position is over
    `stream_state` (its Delta id in the app id, its version the txn version), and every take is whole: the streams
    due are found over all of `stream_state` (no increment of a change feed).

    The whole take is in the table's turn, from the read of `stream_state` to the write-back: `tenant erase` deletes
    a tenant's snapshots (lake and store) in the same turn, after its `stream_state` rows, and none may come back.
    The turn also keeps any other Spark driver from committing to the table meanwhile (S3)."""

    table = SNAPSHOTS
    name = SNAPSHOTS.name
    source = STREAM_STATE
    increments = False

    def __init__(self, store: EventStore, threshold: int) -> None:
        self.store, self.threshold = store, threshold

    def build_here(self, warehouse: Location, turn: Turn, engine: Engine) -> Result | None:
        done = _take_small(warehouse, self.store, self.threshold, turn,
                           bounded=engine.setting != "local" and engine.has_spark)
        return None if done is None else _result(*done)

    def update_on_spark(self, spark: SparkSession, warehouse: Location, turn: Turn) -> Result:
        return _take_in_turn(spark, warehouse, self.store, self.threshold)


def _result(taken: int, written_back: int, state_version: int, previous: int | None,
            engine: Ran = "local") -> Result:
    return Result(SNAPSHOTS.name, state_version, -1 if previous is None else previous, taken, engine,
                  figures={"dagster/row_count": taken, "taken": taken, "written_back": written_back},
                  over=STREAM_STATE.name)


def _take_small(warehouse: Location, store: EventStore, threshold: int, turn: Turn,
                bounded: bool = True) -> tuple[int, int, int, int | None] | None:
    """(taken, written back, stream_state version, the one taken before) of a snapshot run done here, in the table's
    `turn`; None: Spark's to do (`bounded`: past `SMALL_SNAPSHOTS` or `SMALL_SNAPSHOT_ROWS` too)."""
    state_path = STREAM_STATE.path(warehouse)
    snap_path = SNAPSHOTS.path(warehouse)
    SNAPSHOTS.ensure_arrow(warehouse)
    snap = DeltaTable(snap_path)
    if current.has_deletion_vectors(snap) or (bounded and current.row_count(snap) > SMALL_SNAPSHOT_ROWS) or \
            not tables.has_columns(snap, KEY):
        return None  # (a table made before tenants: Spark adds the column)
    # The whole take, the write-back included, in the table's turn, reading `stream_state` once the turn is ours:
    # `tenant erase` deletes a tenant's snapshots (lake and store) in the same turn, after its `stream_state` rows.
    if not tables.is_delta_table(state_path):  # nothing folded yet: only a write-back to redo, if any
        return 0, _write_back(latest(current.files(snap_path, snap).to_table(columns=_TAKEN)), store), -1, None
    state = DeltaTable(state_path)
    if current.has_deletion_vectors(state) or (bounded and current.row_count(state) > SMALL_SNAPSHOTS) or \
            not tables.has_columns(state, KEY):
        return None
    state_version = int(state.version())
    at = Position.of(snap, SNAPSHOTS.app_id_over(str(state.metadata().id)))  # over this `stream_state`
    lake = current.files(snap_path, snap).to_table(columns=_TAKEN)
    held = ["quarantined"] if tables.has_columns(state, ["quarantined"]) else []
    due = _due(current.files(state_path, state).to_table(columns=[*_COLUMNS, *held]), latest(lake), threshold)
    taken = append_batches(due.to_batches(), SNAPSHOTS.schema, snap_path, app_id=at.app_id, version=state_version,
                           table=snap, before_commit=lambda: turn.confirm(snap_path, at.app_id, at.read))
    if taken:  # the lake is the record: what it now holds, these included
        lake = pa.concat_tables([lake, due.select(_TAKEN).cast(lake.schema)])
    elif taken is None:  # this state version was taken already (a replay): read what is there
        lake = current.files(snap_path, DeltaTable(snap_path)).to_table(columns=_TAKEN)
    return taken or 0, _write_back(latest(lake), store), state_version, at.read


def not_in_store_small(warehouse: Location, store: EventStore) -> pa.Table | None:
    """The latest snapshot of each stream in the lake where the store holds another or none (stream_id,
    version, ...); None: too many to read here (the Spark path's `not_in_store` answers)."""
    snap_path = tables.table_path(warehouse, "snapshots")
    if not tables.is_delta_table(snap_path):
        return pa.table({c: pa.array([], SNAPSHOTS.schema.field(c).type) for c in _COLUMNS})
    snap = DeltaTable(snap_path)
    if current.has_deletion_vectors(snap) or current.row_count(snap) > SMALL_SNAPSHOT_ROWS or not tables.has_columns(snap, KEY):
        return None
    return _missing(latest(current.files(snap_path, snap).to_table(columns=_TAKEN)), store)


def latest(snapshots: pa.Table) -> pa.Table:
    """Each stream's latest snapshot: the highest version, then the one taken last (Spark's
    `max(struct(version, taken_at, revision))`): a revision rolled back is taken again at the same version, and that
    take is the state of the revision in service."""
    return tables.latest_per_stream(
        snapshots, [("version", "descending"), ("taken_at", "descending"), ("revision", "descending")])


def _due(state: pa.Table, last: pa.Table, threshold: int) -> pa.Table:
    """The rows of `state` to snapshot now, with their `taken_at`, in the table's schema."""
    last = last.select([*KEY, "version", "revision"]).rename_columns([*KEY, "last_version", "last_revision"])
    j = state.join(last, keys=KEY, join_type="left outer")
    version, last_version = j["version"], j["last_version"]
    grown = pc.and_kleene(pc.is_null(last_version), pc.greater_equal(version, threshold))
    grown = pc.or_kleene(grown, pc.greater_equal(pc.subtract(version, last_version), threshold))
    revised = pc.not_equal(j["last_revision"], j["revision"])
    # A stream without state (its type has no reducer) has nothing to snapshot, nor a quarantined one (docs/decisions/
    # 0051: its state is behind its events); null: not due (as Spark).
    due = j.filter(pc.and_kleene(pc.and_kleene(pc.greater(version, 0), pc.is_valid(j["state"])), pc.or_kleene(grown, revised)))
    if "quarantined" in due.column_names:
        due = due.filter(pc.is_null(due["quarantined"]))
    taken_at = pa.array([datetime.now(UTC)] * due.num_rows, SNAPSHOTS.schema.field("taken_at").type)
    return due.select(_COLUMNS[:-1]).append_column("taken_at", taken_at).append_column("tenant", due["tenant"]).cast(SNAPSHOTS.schema)


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


def _take_in_turn(spark: SparkSession, warehouse: Location, store: EventStore, threshold: int) -> Result:
    from pyspark.sql import functions as F

    state_path = tables.table_path(warehouse, "stream_state")
    snap_path = tables.table_path(warehouse, "snapshots")
    SNAPSHOTS.ensure(spark, warehouse)
    if not tables.has_columns(snap_path, KEY):  # made before tenants: every snapshot is of no tenant ('')
        spark.sql(f"ALTER TABLE delta.`{snap_path}` ADD COLUMNS (tenant STRING)")
        spark.sql(f"UPDATE delta.`{snap_path}` SET tenant = '' WHERE tenant IS NULL")
    if not tables.is_delta_table(state_path):
        return _result(0, write_back(spark, warehouse, store), -1, None, engine="spark")
    state_version = tables.table_version(spark, state_path)
    at = Position.of(snap_path, app_id(state_path))
    state = tables.read(spark, state_path, version=state_version)
    last = tables.read(spark, snap_path).groupBy(*KEY).agg(
        F.max(F.struct("version", "taken_at", "revision")).alias("last"))  # `latest`
    due = (
        state.join(last, KEY, "left")
        .where(
            (F.col("version") > 0) & F.col("state").isNotNull()  # no state: its type has no reducer
            & (F.col("quarantined").isNull() if "quarantined" in state.columns else F.lit(True))  # held back
            & (
                F.col("last").isNull()
                & (F.col("version") >= threshold)
                | (F.col("version") - F.col("last.version") >= threshold)
                | (F.col("last.revision") != F.col("revision"))
            )
        )
        .select("stream_id", "stream_type", "version", "state", "revision", F.current_timestamp().alias("taken_at"),
                "tenant")
        .cache()
    )
    try:
        taken = due.count()
        if taken:
            (due.write.format("delta").mode("append")
             .option("txnAppId", at.app_id).option("txnVersion", str(state_version)).save(snap_path))
    finally:
        due.unpersist()
    # Read back from the table, not from `due`: the append invalidates `due`'s cache, and recomputed
    # against the new snapshots it is empty (that lost every write-back once). The lake is the record.
    return _result(taken, write_back(spark, warehouse, store), state_version, at.read, engine="spark")


def not_in_store(spark: SparkSession, warehouse: Location, store: EventStore) -> Any:
    """The latest snapshot of each stream in the lake, where the store holds another (or none): a DataFrame."""
    from pyspark.sql import functions as F

    snap_path = tables.table_path(warehouse, "snapshots")
    if not tables.is_delta_table(snap_path):  # no snapshot taken yet: none to write back
        return spark.createDataFrame(
            [], "stream_id STRING, stream_type STRING, version INT, state STRING, revision INT, tenant STRING")
    latest = (
        tables.read(spark, snap_path).groupBy(*KEY)
        .agg(F.max(F.struct("version", "taken_at", "revision", "stream_type", "state")).alias("s"))  # `latest`
        .select("stream_id", "s.stream_type", "s.version", "s.state", "s.revision", "tenant")
    )
    held = spark.createDataFrame(store.snapshot_keys(),
                                 "tenant STRING, stream_id STRING, held_version INT, held_revision INT")
    return latest.join(held, KEY, "left").where(
        F.col("held_version").isNull() | (F.col("held_version") != F.col("version"))
        | (F.col("held_revision") != F.col("revision"))
    ).drop("held_version", "held_revision")


def write_back(spark: SparkSession, warehouse: Location, store: EventStore) -> int:
    """Upsert into the store's snapshot table every latest snapshot of the lake it does not hold; the count."""
    if not store.has_snapshots_table():  # a store not migrated (or adopted) since: the check says so
        return 0
    missing = not_in_store(spark, warehouse, store)
    return store.write_snapshots(
        Snapshot(r["stream_id"], r["stream_type"], r["version"], json.loads(r["state"]), r["revision"], r["tenant"])
        for r in missing.toLocalIterator()
    )
