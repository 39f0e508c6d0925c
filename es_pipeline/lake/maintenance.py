"""Delta table upkeep: compaction and vacuum of every table under the warehouse.

Only delta-rs commits to `events` (put-if-absent on object storage, a hard link on a local disk;
delta-spark's log stores exclude only writers inside one JVM, docs/decisions.md), so `events` is
compacted and vacuumed with delta-rs, while extractions append to it. The Spark tables are compacted in their update's turn (`serial.one_at_a_time`, the lock their
updates take), so no other Spark driver commits to one meanwhile; on S3 without a store to hold that
lock in, they are left alone.
"""

from __future__ import annotations

from typing import Any

from deltalake import DeltaTable

from es_pipeline.lake import tables
from es_pipeline.lake.serial import one_at_a_time
from es_pipeline.lake.tables import Location


def maintain(
    spark: Any, warehouse: Location, *, retain_hours: int = 168, store_dsn: str | None = None
) -> dict[str, dict[str, int]]:
    """Compact the small files of frequent commits, then vacuum files older than `retain_hours`.

    168 hours (Delta's default) keeps a week of time travel and protects readers and writers that
    started before the vacuum. Delta writes a checkpoint every 10 commits by itself.
    """
    out: dict[str, dict[str, int]] = {}
    for name in tables.TABLES:
        path = tables.table_path(warehouse, name)
        if not tables.is_delta_table(path):
            continue
        if name == "events":
            # In the table's turn: `tenant erase` purges untracked files of `events` in the same turn, which
            # would take a compaction's files before it commits them.
            with one_at_a_time(store_dsn, name):
                out[name] = compact_with_delta_rs(path, retain_hours=retain_hours)
            continue
        if tables.is_uri(warehouse) and store_dsn is None:
            continue
        with one_at_a_time(store_dsn, name):
            metrics = spark.sql(f"OPTIMIZE delta.`{path}`").first()["metrics"]
            spark.sql(f"VACUUM delta.`{path}` RETAIN {int(retain_hours)} HOURS")
        out[name] = {
            "files_removed": int(metrics["numFilesRemoved"]),
            "files_added": int(metrics["numFilesAdded"]),
        }
    return out


def compact_with_delta_rs(path: str, *, retain_hours: int) -> dict[str, int]:
    """delta-rs's compaction and vacuum: commits that race appends by other processes safely (put-if-absent)."""
    table = DeltaTable(path)
    metrics = table.optimize.compact()
    table.vacuum(retention_hours=retain_hours, dry_run=False, enforce_retention_duration=False)
    return {"files_removed": int(metrics["numFilesRemoved"]), "files_added": int(metrics["numFilesAdded"])}
