"""Delta table upkeep: compaction and vacuum of every table under the warehouse (Spark)."""

from __future__ import annotations

from typing import Any

from es_pipeline.lake import tables
from es_pipeline.lake.tables import Location


def maintain(spark: Any, warehouse: Location, *, retain_hours: int = 168) -> dict[str, dict[str, int]]:
    """Compact the small files of frequent commits, then vacuum files older than `retain_hours`.

    168 hours (Delta's default) keeps a week of time travel and protects readers and writers that
    started before the vacuum. Delta writes a checkpoint every 10 commits by itself.
    """
    out: dict[str, dict[str, int]] = {}
    for name in tables.TABLES:
        path = tables.table_path(warehouse, name)
        if not tables.is_delta_table(path):
            continue
        metrics = spark.sql(f"OPTIMIZE delta.`{path}`").first()["metrics"]
        spark.sql(f"VACUUM delta.`{path}` RETAIN {int(retain_hours)} HOURS")
        out[name] = {
            "files_removed": int(metrics["numFilesRemoved"]),
            "files_added": int(metrics["numFilesAdded"]),
        }
    return out
