"""Read models over the Delta `events` table, in Spark (no Dagster here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from es_pipeline import lake


def build_stream_catalog(spark: Any, warehouse: Path) -> int:
    """One row per stream: type, first and last event time, event count, version. Returns rows."""
    events = spark.read.format("delta").load(lake.table_path(warehouse, "events"))
    catalog = events.groupBy("stream_id").agg(
        {"stream_type": "first", "recorded_at": "min", "version": "max", "global_position": "count"}
    )
    catalog = catalog.selectExpr(
        "stream_id", "`first(stream_type)` AS stream_type", "`min(recorded_at)` AS first_event_at",
        "`max(version)` AS version", "`count(global_position)` AS events",
    ).join(
        events.groupBy("stream_id").agg({"recorded_at": "max"}).withColumnRenamed("max(recorded_at)", "last_event_at"),
        "stream_id",
    )
    catalog.write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(
        lake.table_path(warehouse, "stream_catalog")
    )
    return int(spark.read.format("delta").load(lake.table_path(warehouse, "stream_catalog")).count())


def build_event_type_daily(spark: Any, warehouse: Path) -> int:
    """Stream type x event type x day: count. Returns rows."""
    events = spark.read.format("delta").load(lake.table_path(warehouse, "events"))
    daily = events.groupBy("stream_type", "event_type", "event_date").count().withColumnRenamed("count", "events")
    path = lake.table_path(warehouse, "event_type_daily")
    daily.write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(path)
    return int(spark.read.format("delta").load(path).count())


def maintain(spark: Any, warehouse: Path, *, retain_hours: int = 168) -> dict[str, dict[str, int]]:
    """Compact the small files of frequent commits, then vacuum files older than `retain_hours`.

    168 hours (Delta's default) keeps a week of time travel and protects readers and writers that
    started before the vacuum. Delta writes a checkpoint every 10 commits by itself.
    """
    out: dict[str, dict[str, int]] = {}
    for name in lake.TABLES:
        path = lake.table_path(warehouse, name)
        if not lake.is_delta_table(path):
            continue
        metrics = spark.sql(f"OPTIMIZE delta.`{path}`").first()["metrics"]
        spark.sql(f"VACUUM delta.`{path}` RETAIN {int(retain_hours)} HOURS")
        out[name] = {
            "files_removed": int(metrics["numFilesRemoved"]),
            "files_added": int(metrics["numFilesAdded"]),
        }
    return out
