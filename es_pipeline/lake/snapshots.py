"""Snapshots: for streams that grew past a threshold since their last snapshot, or whose reducer
revision changed, append (stream, version, state, revision) to the Delta `snapshots` table and
write it back to the event store's `es.snapshots`, so that `load` = snapshot + later events.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from es_pipeline.lake import tables
from es_pipeline.store.event_store import EventStore, Snapshot

APP_ID = "es_pipeline.snapshots"
SNAPSHOTS_DDL = "stream_id STRING, stream_type STRING, version INT, state STRING, revision INT, taken_at TIMESTAMP"
DEFAULT_THRESHOLD = 50


@dataclass(frozen=True)
class SnapshotResult:
    taken: int
    written_back: int
    state_version: int


def take_snapshots(spark: Any, warehouse: Path, store: EventStore, *, threshold: int = DEFAULT_THRESHOLD) -> SnapshotResult:
    from pyspark.sql import functions as F

    state_path = tables.table_path(warehouse, "stream_state")
    snap_path = tables.table_path(warehouse, "snapshots")
    tables.ensure_table(spark, snap_path, SNAPSHOTS_DDL, comment="es_pipeline: snapshots taken per stream and version")
    if not tables.is_delta_table(state_path):
        return SnapshotResult(0, 0, -1)
    state_version = tables.table_version(spark, state_path)
    state = tables.read(spark, state_path, version=state_version)
    last = tables.read(spark, snap_path).groupBy("stream_id").agg(
        F.max(F.struct("version", "revision")).alias("last")
    )
    due = (
        state.join(last, "stream_id", "left")
        .where(
            (F.col("version") > 0)
            & (
                F.col("last").isNull()
                & (F.col("version") >= threshold)
                | (F.col("version") - F.col("last.version") >= threshold)
                | (F.col("last.revision") != F.col("revision"))
            )
        )
        .select("stream_id", "stream_type", "version", "state", "revision", F.current_timestamp().alias("taken_at"))
        .cache()
    )
    try:
        taken = due.count()
        if taken:
            (due.write.format("delta").mode("append")
             .option("txnAppId", APP_ID).option("txnVersion", str(state_version)).save(snap_path))
        written = store.write_snapshots(
            Snapshot(r["stream_id"], r["stream_type"], r["version"], json.loads(r["state"]), r["revision"])
            for r in due.toLocalIterator()
        )
    finally:
        due.unpersist()
    return SnapshotResult(taken, written, state_version)
