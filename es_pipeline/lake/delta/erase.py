"""A tenant's rows out of a Delta table, and out of its files: delete, vacuum, purge the change data.

A Delta DELETE only adds a version without the rows: the files that held them stay for time travel,
and with the change data feed on, the DELETE writes the rows once more into `_change_data/`. Erasing
means all three are gone: `delete_tenant` rewrites the files (delta-rs writes no deletion vectors, so
no file keeps a row that is merely marked deleted), `purge` vacuums with no retention and removes the
change data files, and `leftovers` reads every Parquet file under the table to prove it. The caller
holds the table's writers off meanwhile (the slice locks for `events`, the table's turn for the others).

What stays: the Delta log's JSON keeps, for the files it added and removed, per-file min/max statistics
of the columns it has statistics for (a stream id may be one), until the log is cleaned up after
`delta.logRetentionDuration` (docs/sources.md, "Erasing a tenant").
"""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError

from es_pipeline.lake.delta import tables

log = logging.getLogger(__name__)

COMMIT_ATTEMPTS = 20  # a DELETE that lost its version to a compaction is tried again on the new version


def _literal(tenant: str) -> str:
    return "'" + tenant.replace("'", "''") + "'"


def delete_tenant(path: str, tenant: str, *, advance: tuple[str, int] | None = None) -> tuple[int, int] | None:
    """Delete `tenant`'s rows; (rows deleted, the version committed), or None when the table has no such rows.

    `advance`: (app id, version) recorded with the DELETE, for a projection that was up to date with `events`
    before the erasure: its next update then starts after the erasure instead of rebuilding whole."""
    if not tables.is_delta_table(path):
        return None
    for attempt in range(COMMIT_ATTEMPTS):
        table = DeltaTable(path)
        if not tables.has_columns(table, ["tenant"]):
            return None  # a table of a release before tenants: every row is the tenant ''
        props = CommitProperties(app_transactions=[Transaction(*advance)]) if advance else None
        try:
            metrics = table.delete(f"tenant = {_literal(tenant)}", commit_properties=props)
        except CommitFailedError:
            if attempt == COMMIT_ATTEMPTS - 1:
                raise
            log.info("%s: the delete lost its version to another commit; trying again", path)
            continue
        deleted = int(metrics.get("num_deleted_rows", 0))
        return (deleted, table.version()) if deleted else None
    return None


def purge(path: str) -> int:
    """Remove every file the table no longer references, at once (those of older versions, and those no version
    ever referenced: a killed writer's), and its change data files; the count removed. Only while no writer of
    the table is at work (its turn, or the slice locks for `events`): a file being written would go too."""
    if not tables.is_delta_table(path):
        return 0
    removed = len(DeltaTable(path).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False, full=True))
    fs, root = tables.filesystem(path)
    listed = fs.get_file_info(pafs.FileSelector(f"{root}/_change_data", recursive=True, allow_not_found=True))
    for info in listed:
        if info.type == pafs.FileType.File:
            fs.delete_file(info.path)
            removed += 1
    return removed


def data_files(path: str) -> list[str]:
    """Every Parquet file under the table, referenced or not (the log's own files aside)."""
    fs, root = tables.filesystem(path)
    listed = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    return [i.path for i in listed if i.type == pafs.FileType.File and i.path.endswith(".parquet")
            and "/_delta_log/" not in i.path]


def leftovers(path: str, tenant: str) -> list[str]:
    """The Parquet files under the table that still hold a row of `tenant` (none after an erasure)."""
    fs, _ = tables.filesystem(path)
    found = []
    for name in data_files(path):
        if "tenant" not in pq.read_schema(name, filesystem=fs).names:
            continue
        column = pq.read_table(name, columns=["tenant"], filesystem=fs)["tenant"].cast(pa.string())
        if pc.any(pc.equal(column, tenant)).as_py():
            found.append(name)
    return found


def tenant_counts(path: str) -> dict[str, int]:
    """Events per tenant in the table now (for `status` and the checks: which tenants the lake holds)."""
    if not tables.is_delta_table(path):
        return {}
    table = DeltaTable(path)
    if not tables.has_columns(table, ["tenant"]):
        return {}
    column = table.to_pyarrow_dataset().to_table(columns=["tenant"]).cast(pa.schema([pa.field("tenant", pa.string())]))
    counts = column.group_by("tenant").aggregate([([], "count_all")])
    return {str(t if t is not None else ""): int(n) for t, n in zip(counts["tenant"].to_pylist(),
                                                                   counts["count_all"].to_pylist(), strict=True)}
