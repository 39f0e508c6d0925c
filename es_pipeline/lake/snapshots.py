"""Snapshots: for streams that grew past a threshold since their last snapshot, or whose reducer
revision changed, append (stream, version, state, revision) to the Delta `snapshots` table and
write it back to the event store's `es.snapshots`, so that `load` = snapshot + later events.

Up to `SMALL_SNAPSHOTS` streams, this is done without a JVM (`lake/small_snapshots.py`): pyarrow finds
the streams due and delta-rs appends them under the same Delta transaction id (app id, state version) and
the same lock in the store as Spark's append. Larger tables, and tables delta-rs should not write, take
the Spark path here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from es_pipeline.lake import tables
from es_pipeline.lake.serial import one_at_a_time
from es_pipeline.lake.tables import Location
from es_pipeline.store.event_store import EventStore, Snapshot

APP_ID = "es_pipeline.snapshots"
SNAPSHOTS_DDL = ("stream_id STRING, stream_type STRING, version INT, state STRING, revision INT, taken_at TIMESTAMP, "
                 "tenant STRING")
KEY = ["tenant", "stream_id"]
DEFAULT_THRESHOLD = 50


@dataclass(frozen=True)
class SnapshotResult:
    taken: int
    written_back: int
    state_version: int


def take_snapshots(
    spark: Any, warehouse: Location, store: EventStore, *, threshold: int = DEFAULT_THRESHOLD, small: bool = True
) -> SnapshotResult:
    """Append the snapshots now due to the Delta table, then write back to the store every latest
    snapshot of the lake that the store does not hold (these, and any a failed run left behind).

    `spark`: a session, or a function that returns one, called only if Spark is needed (see the module)."""
    if small:
        from es_pipeline.lake.small_snapshots import take_small

        done = take_small(warehouse, store, threshold)
        if done is not None:
            return SnapshotResult(*done)
    return _take_with_spark(tables.session_of(spark), warehouse, store, threshold)


def _take_with_spark(spark: Any, warehouse: Location, store: EventStore, threshold: int) -> SnapshotResult:
    # In the table's turn from the read of `stream_state` to the write-back: `tenant erase` deletes a tenant's
    # snapshots (lake and store) in the same turn, after its `stream_state` rows, and none may come back. The
    # turn also keeps any other Spark driver from committing to the table meanwhile (S3).
    with one_at_a_time(store.dsn, "snapshots"):
        return _take_in_turn(spark, warehouse, store, threshold)


def _take_in_turn(spark: Any, warehouse: Location, store: EventStore, threshold: int) -> SnapshotResult:
    from pyspark.sql import functions as F

    state_path = tables.table_path(warehouse, "stream_state")
    snap_path = tables.table_path(warehouse, "snapshots")
    tables.ensure_table(spark, snap_path, SNAPSHOTS_DDL, comment="es_pipeline: snapshots taken per stream and version")
    if not tables.has_columns(snap_path, KEY):  # made before tenants: every snapshot is of no tenant ('')
        spark.sql(f"ALTER TABLE delta.`{snap_path}` ADD COLUMNS (tenant STRING)")
        spark.sql(f"UPDATE delta.`{snap_path}` SET tenant = '' WHERE tenant IS NULL")
    if not tables.is_delta_table(state_path):
        return SnapshotResult(0, write_back(spark, warehouse, store), -1)
    state_version = tables.table_version(spark, state_path)
    state = tables.read(spark, state_path, version=state_version)
    last = tables.read(spark, snap_path).groupBy(*KEY).agg(F.max(F.struct("version", "revision")).alias("last"))
    due = (
        state.join(last, KEY, "left")
        .where(
            (F.col("version") > 0) & F.col("state").isNotNull()  # no state: its type has no reducer
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
             .option("txnAppId", APP_ID).option("txnVersion", str(state_version)).save(snap_path))
    finally:
        due.unpersist()
    # Read back from the table, not from `due`: the append invalidates `due`'s cache, and recomputed
    # against the new snapshots it is empty (that lost every write-back once). The lake is the record.
    return SnapshotResult(taken, write_back(spark, warehouse, store), state_version)


def not_in_store(spark: Any, warehouse: Location, store: EventStore) -> Any:
    """The latest snapshot of each stream in the lake, where the store holds another (or none): a DataFrame."""
    from pyspark.sql import functions as F

    snap_path = tables.table_path(warehouse, "snapshots")
    if not tables.is_delta_table(snap_path):  # no snapshot taken yet: none to write back
        return spark.createDataFrame(
            [], "stream_id STRING, stream_type STRING, version INT, state STRING, revision INT, tenant STRING")
    latest = (
        tables.read(spark, snap_path).groupBy(*KEY)
        .agg(F.max(F.struct("version", "revision", "stream_type", "state")).alias("s"))
        .select("stream_id", "s.stream_type", "s.version", "s.state", "s.revision", "tenant")
    )
    held = spark.createDataFrame(store.snapshot_keys(),
                                 "tenant STRING, stream_id STRING, held_version INT, held_revision INT")
    return latest.join(held, KEY, "left").where(
        F.col("held_version").isNull() | (F.col("held_version") != F.col("version"))
        | (F.col("held_revision") != F.col("revision"))
    ).drop("held_version", "held_revision")


def write_back(spark: Any, warehouse: Location, store: EventStore) -> int:
    """Upsert into the store's snapshot table every latest snapshot of the lake it does not hold; the count."""
    if not store.has_snapshots_table():  # a store not migrated (or adopted) since: the check says so
        return 0
    missing = not_in_store(spark, warehouse, store)
    return store.write_snapshots(
        Snapshot(r["stream_id"], r["stream_type"], r["version"], json.loads(r["state"]), r["revision"], r["tenant"])
        for r in missing.toLocalIterator()
    )
