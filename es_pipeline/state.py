"""`stream_state`: one row per stream, folded incrementally from `events` by the reducers (Spark).

Each run folds only what is new since the last run: the rows that the Delta commits of `events`
after the last processed table version added (read through Delta's change data feed, so the cost
follows the increment, not the table), onto the previous state of the streams they touch, in
version order, grouped per stream in pandas (`applyInPandas`: one Python call per stream, not per
row through the driver). The events table version processed is committed atomically with the
state, as the MERGE's Delta transaction id (`txnAppId`/`txnVersion`), so a crash or a retry never
folds an event twice.

A stream's versions can reach the lake out of order (two transactions whose xids are in the other
order than their commits), so only the contiguous run after the folded version is applied; later
events wait in the row's `parked` column, and are folded when the gap fills.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from es_pipeline import lake
from es_pipeline.errors import ReducerError
from es_pipeline.reducers import REGISTRY, Event, Reducer, UnknownEventType
from es_pipeline.reducers import revisions as current_revisions

APP_ID = "es_pipeline.stream_state"

STATE_DDL = (
    "stream_id STRING, stream_type STRING, version INT, state STRING, last_event_at TIMESTAMP, "
    "revision INT, parked STRING, skipped INT, updated_at TIMESTAMP"
)
_FOLD_OUT = (
    "stream_id STRING, stream_type STRING, version INT, state STRING, last_event_at TIMESTAMP, "
    "revision INT, parked STRING, skipped INT, folded INT, error STRING"
)
_PARKED_SCHEMA = "ARRAY<STRUCT<version: INT, event_type: STRING, payload: STRING, recorded_at: TIMESTAMP>>"


@dataclass(frozen=True)
class StateResult:
    events_version: int
    previous_events_version: int
    events_folded: int
    streams_updated: int
    rebuilt_types: tuple[str, ...]
    parked_streams: int
    skipped_unknown: int


# The Delta txn version of a stream_state commit encodes the events table version folded and the
# sum of the reducer revisions, so that a revision bump with no new events still commits (Delta
# skips a txn version it has seen) while a replay of the same work does not.
_REVISION_SLOTS = 1000


def _txn_version(events_version: int, registry: dict[str, Reducer]) -> int:
    return events_version * _REVISION_SLOTS + min(_REVISION_SLOTS - 1, sum(r.revision for r in registry.values()))


def _processed_version(path: str) -> int:
    v = lake.transaction_version(path, APP_ID)
    return -1 if v is None else v // _REVISION_SLOTS


def _fold_group(registry: dict[str, Reducer], skip_unknown: bool):  # type: ignore[no-untyped-def]
    """The per-stream fold, shipped to Python workers with the reducers captured (not re-imported)."""
    import pandas as pd

    def fold(pdf: pd.DataFrame) -> pd.DataFrame:
        first = pdf.iloc[0]
        stream_id, stream_type = first["stream_id"], first["stream_type"]
        has_prior = pd.notna(first["prior_version"])
        state = json.loads(first["prior_state"]) if has_prior else {}
        version = int(first["prior_version"]) if has_prior else 0
        last_at = first["prior_last_event_at"] if has_prior else None
        skipped = int(first["prior_skipped"]) if has_prior and pd.notna(first["prior_skipped"]) else 0
        folded = 0
        reducer = registry.get(stream_type)
        error = None
        rows = pdf.dropna(subset=["version"]).drop_duplicates("version").sort_values("version")
        parked: list[dict[str, Any]] = []
        for row in rows.itertuples(index=False):
            v = int(row.version)
            if v <= version:
                continue
            if v != version + 1 or parked:
                parked.append({"version": v, "event_type": row.event_type, "payload": row.payload,
                               "recorded_at": row.recorded_at})
                continue
            event = Event(stream_id, v, row.event_type, json.loads(row.payload))
            try:
                if reducer is None:
                    raise UnknownEventType(event)
                state = reducer.fold(state, event)
            except UnknownEventType as exc:
                if not skip_unknown:
                    error = json.dumps([stream_id, v, row.event_type, str(exc)])
                    break
                skipped += 1
            except KeyError as exc:
                error = json.dumps([stream_id, v, row.event_type, f"the payload has no field {exc}"])
                break
            except Exception as exc:  # noqa: BLE001 - any reducer failure is reported, with its place
                error = json.dumps([stream_id, v, row.event_type, f"{type(exc).__name__}: {exc}"])
                break
            version, last_at = v, row.recorded_at
            folded += 1
        return pd.DataFrame([{
            "stream_id": stream_id, "stream_type": stream_type, "version": version,
            "state": json.dumps(state, sort_keys=True, separators=(",", ":")), "last_event_at": last_at,
            "revision": reducer.revision if reducer else 0,
            "parked": json.dumps(parked, default=str) if parked else None,
            "skipped": skipped, "folded": folded, "error": error,
        }])

    return fold


def update_stream_state(spark: Any, warehouse: Path, *, skip_unknown: bool = False) -> StateResult:
    from pyspark.sql import functions as F

    events_path = lake.table_path(warehouse, "events")
    state_path = lake.table_path(warehouse, "stream_state")
    lake.ensure_table(spark, state_path, STATE_DDL, comment="es_pipeline: current state per stream")
    now = lake.table_version(spark, events_path)
    prev = _processed_version(state_path)
    revisions = current_revisions()
    state = spark.read.format("delta").load(state_path)

    stale = [
        r["stream_type"] for r in state.select("stream_type", "revision").distinct().collect()
        if r["stream_type"] in revisions and revisions[r["stream_type"]] != r["revision"]
    ]
    cols = ["stream_id", "stream_type", "version", "event_type", "payload", "recorded_at"]
    if prev < 0:
        new = spark.read.format("delta").option("versionAsOf", now).load(events_path).select(*cols)
    elif prev < now:
        new = (
            spark.read.format("delta").option("readChangeFeed", "true")
            .option("startingVersion", prev + 1).option("endingVersion", now).load(events_path)
            .where("_change_type = 'insert'").select(*cols)
        )
    else:
        new = None
    if stale:
        rebuild = spark.read.format("delta").option("versionAsOf", now).load(events_path) \
            .where(F.col("stream_type").isin(stale)).select(*cols)
        new = rebuild if new is None else new.where(~F.col("stream_type").isin(stale)).unionByName(rebuild)
    if new is None:
        return StateResult(now, prev, 0, 0, (), 0, 0)

    prior = state.where(~F.col("stream_type").isin(stale)) if stale else state
    parked = (
        prior.where("parked IS NOT NULL")
        .select("stream_id", "stream_type", F.explode(F.from_json("parked", _PARKED_SCHEMA)).alias("p"))
        .select("stream_id", "stream_type", "p.version", "p.event_type", "p.payload", "p.recorded_at")
    )
    todo = new.unionByName(parked)
    touched = todo.select("stream_id").distinct()
    prior_cols = prior.join(touched, "stream_id", "left_semi").select(
        "stream_id",
        F.col("state").alias("prior_state"), F.col("version").alias("prior_version"),
        F.col("last_event_at").alias("prior_last_event_at"), F.col("skipped").alias("prior_skipped"),
    )
    folded = (
        todo.join(prior_cols, "stream_id", "left")
        .groupBy("stream_id")
        .applyInPandas(_fold_group(dict(REGISTRY), skip_unknown), _FOLD_OUT)
        .cache()
    )
    try:
        # One action computes the fold (cached) and its figures; the first error, if any, is in it.
        stats = folded.agg(
            F.count("*").alias("streams"), F.sum(F.when(F.col("parked").isNotNull(), 1).otherwise(0)).alias("parked"),
            F.sum("skipped").alias("skipped"), F.sum("folded").alias("folded"), F.min("error").alias("error"),
        ).first()
        if stats["error"] is not None:
            stream_id, version, event_type, reason = json.loads(stats["error"])
            raise ReducerError(stream_id, version, event_type, reason)
        n_events = stats["folded"] or 0
        updates = folded.drop("error", "folded").withColumn("updated_at", F.current_timestamp())
        lake.merge_by_key(spark, state_path, updates, "stream_id", app_id=APP_ID, version=_txn_version(now, REGISTRY))
    finally:
        folded.unpersist()
    return StateResult(now, prev, int(n_events), int(stats["streams"] or 0), tuple(stale),
                       int(stats["parked"] or 0), int(stats["skipped"] or 0))
