"""Delta table upkeep: compaction and vacuum of every table under the warehouse, by delta-rs, without a JVM.

Each table is compacted in its update's turn (`serial.one_at_a_time`, the lock its updates take), so that
nothing else commits to it meanwhile. `events` is committed only by delta-rs (put-if-absent on object
storage, a hard link on a local disk; delta-spark's log stores exclude only writers inside one JVM,
docs/decisions.md), and its appends go on during a compaction: delta-rs's commit is safe against them,
and the turn keeps out `tenant erase`, which purges untracked files that a compaction has not committed yet.
The projections and `snapshots` are committed by Spark and by delta-rs, always in their turn: on S3
without a store to hold that turn in, they are left alone.

Spark's OPTIMIZE and VACUUM did the projections' compaction before: 93 s and 152 core-seconds an hour on
a 13k-event lake through the Spark Connect server, more than the whole tailing loop costs in twenty
minutes (bench/results/steady_state.md).
"""

from __future__ import annotations

from deltalake import DeltaTable

from es_pipeline.lake import inventory
from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.kernel.turn import one_at_a_time


def maintain(warehouse: Location, *, retain_hours: int = 168, store_dsn: str | None = None) -> dict[str, dict[str, int]]:
    """Compact the small files of frequent commits, then vacuum files older than `retain_hours`.

    168 hours (Delta's default) keeps a week of time travel and protects readers and writers that
    started before the vacuum.
    """
    out: dict[str, dict[str, int]] = {}
    for name in inventory.lake_tables(warehouse):
        path = tables.table_path(warehouse, name)
        if not tables.is_delta_table(path):
            continue
        if name != "events" and tables.is_uri(warehouse) and store_dsn is None:
            continue
        with one_at_a_time(store_dsn, inventory.turn_of(name)):
            out[name] = compact_with_delta_rs(path, retain_hours=retain_hours)
    return out


def compact_with_delta_rs(path: str, *, retain_hours: int) -> dict[str, int]:
    """delta-rs's compaction and vacuum: commits that race appends by other processes safely (put-if-absent)."""
    table = DeltaTable(path)
    metrics = table.optimize.compact()
    table.vacuum(retention_hours=retain_hours, dry_run=False, enforce_retention_duration=False)
    return {"files_removed": int(metrics["numFilesRemoved"]), "files_added": int(metrics["numFilesAdded"])}
