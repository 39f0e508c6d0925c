"""Streaming Arrow appends to a Delta table: one Delta transaction, memory bounded whatever its size.

`write_deltalake` (delta-rs 1.6) holds about three times the data it writes in memory, measured here
with a 300 MB stream, so a batch of one large transaction could not pass through a run. Here the
record batches go straight into Parquet files (a new file every `TARGET_FILE_BYTES`, a row group
every `ROW_GROUP_BYTES` of Arrow data), per-file statistics are gathered on the way, and the files
are committed together with delta-rs's `create_write_transaction`, carrying the same `txn` action
(app id, version) as before. Memory holds one row group, not the batch.

Spark, where it does the work (the executors' JDBC reads on a cluster, the Spark writer), writes the
Parquet files only, into a folder of the table, and `commit_parquet_folder` commits them the same way,
with statistics from the files' footers: delta-rs is the one engine that commits to `events`, with
put-if-absent on object storage, so no commit of one writer can overwrite another's (docs/decisions.md).

A run killed before the commit leaves Parquet files that no commit names: readers never see them,
and `VACUUM` (`delta_maintenance_job`) deletes them once older than the retention.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.transaction import AddAction, RemoveAction

from es_pipeline.lake.delta.tables import filesystem

TARGET_FILE_BYTES = 128 << 20  # Parquet bytes per file before the next file starts
ROW_GROUP_BYTES = 64 << 20  # Arrow bytes gathered before they are written as one row group
DEFAULT_INDEXED_COLUMNS = 32  # Delta's default `dataSkippingNumIndexedCols`
MAX_STAT_STRING = 256  # a longer string min/max is left out of the statistics (readers then do not skip)
# A blind append never conflicts with another, but loses the race for the next version to each concurrent
# committer (every range's run commits to `events`): delta-rs's default of 15 retries failed runs with 16
# writers on one table (measured on s3proxy); each retry costs one read of the new log entries.
COMMIT_RETRIES = 200


@dataclass
class _Stats:
    """Delta file statistics (numRecords, minValues, maxValues, nullCount) gathered chunk by chunk."""

    columns: list[str]
    rows: int = 0
    mins: dict[str, Any] = field(default_factory=dict)
    maxs: dict[str, Any] = field(default_factory=dict)
    nulls: dict[str, int] = field(default_factory=dict)

    def add(self, table: pa.Table) -> None:
        self.rows += table.num_rows
        for name in self.columns:
            column = table[name]
            self.nulls[name] = self.nulls.get(name, 0) + column.null_count
            if column.null_count == len(column):
                continue
            bounds = pc.min_max(column)
            lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
            self.mins[name] = lo if name not in self.mins else min(self.mins[name], lo)
            self.maxs[name] = hi if name not in self.maxs else max(self.maxs[name], hi)

    def add_footer(self, metadata: pq.FileMetaData) -> None:
        """The statistics of a Parquet file written elsewhere (Spark), from its row groups' statistics.

        A column with values but no min/max in some row group gets no bounds at all (a reader must not
        skip on bounds that do not cover every value)."""
        names = metadata.schema.to_arrow_schema().names
        unbounded: set[str] = set()
        for g in range(metadata.num_row_groups):
            group = metadata.row_group(g)
            self.rows += group.num_rows
            for name in self.columns:
                if name not in names:
                    continue
                stats = group.column(names.index(name)).statistics
                if stats is None or not stats.has_null_count:
                    unbounded.add(name)
                    continue
                self.nulls[name] = self.nulls.get(name, 0) + stats.null_count
                if stats.null_count == group.num_rows:
                    continue
                if not stats.has_min_max:
                    unbounded.add(name)
                    continue
                lo, hi = stats.min, stats.max
                self.mins[name] = lo if name not in self.mins else min(self.mins[name], lo)
                self.maxs[name] = hi if name not in self.maxs else max(self.maxs[name], hi)
        for name in unbounded:
            self.mins.pop(name, None)
            self.maxs.pop(name, None)
            self.nulls.pop(name, None)

    def to_json(self) -> str:
        return json.dumps({
            "numRecords": self.rows,
            "minValues": _stat_values(self.mins),
            "maxValues": _stat_values(self.maxs),
            "nullCount": self.nulls,
        })


def _stat_values(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, dt.datetime):
            value = value if value.tzinfo else value.replace(tzinfo=dt.UTC)  # Parquet's UTC-adjusted timestamps
            out[name] = value.astimezone(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        elif isinstance(value, dt.date):
            out[name] = value.isoformat()
        elif isinstance(value, str) and len(value) > MAX_STAT_STRING:
            continue
        else:
            out[name] = value
    return out


def stats_columns(table: DeltaTable, schema: pa.Schema) -> list[str]:
    """The columns Delta keeps statistics for: `delta.dataSkippingStatsColumns`, else the first 32."""
    config = table.metadata().configuration
    named = config.get("delta.dataSkippingStatsColumns")
    if named:
        return [c.strip() for c in named.split(",") if c.strip() in schema.names]
    count = int(config.get("delta.dataSkippingNumIndexedCols") or DEFAULT_INDEXED_COLUMNS)
    return schema.names[: max(count, 0)] if count >= 0 else schema.names


class _FileWriter:
    """Parquet files under the table's folder, rolled over at `TARGET_FILE_BYTES`."""

    def __init__(self, path: str, schema: pa.Schema, stats: list[str]) -> None:
        self.fs: pafs.FileSystem
        self.root: str
        self.fs, self.root = filesystem(path)
        self.schema = schema
        self.stats_names = stats
        self.actions: list[AddAction | RemoveAction] = []
        self._sink: Any = None
        self._writer: pq.ParquetWriter | None = None
        self._name = ""
        self._stats = _Stats(stats)

    def write(self, table: pa.Table) -> None:
        if self._writer is None:
            self._name = f"part-{len(self.actions):05d}-{uuid.uuid4()}-c000.snappy.parquet"
            self._sink = self.fs.open_output_stream(f"{self.root}/{self._name}")
            self._writer = pq.ParquetWriter(self._sink, self.schema, compression="snappy")
            self._stats = _Stats(self.stats_names)
        self._writer.write_table(table, row_group_size=max(table.num_rows, 1))
        self._stats.add(table)
        if self._sink.tell() >= TARGET_FILE_BYTES:
            self.close_file()

    def close_file(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._sink.close()
        size = self.fs.get_file_info(f"{self.root}/{self._name}").size
        self.actions.append(AddAction(
            path=self._name, size=int(size), partition_values={}, modification_time=int(time.time() * 1000),
            data_change=True, stats=self._stats.to_json(),
        ))
        self._writer = None


def append_batches(
    batches: Iterable[pa.RecordBatch], schema: pa.Schema, path: str, *, app_id: str, version: int,
    before_commit: Callable[[], None] | None = None, table: DeltaTable | None = None,
) -> int | None:
    """Append record batches as Delta transaction (`app_id`, `version`): the rows written, or None if skipped.

    A version at or below the one Delta holds for `app_id` is a replay and writes nothing (the same
    `txn` action as Spark's `txnAppId`/`txnVersion`, so either writer sees the other's commits).
    Callers serialize the writers of one `app_id` (the slice locks), so reading the version and then
    committing cannot race. No rows, no commit: 0. `before_commit` runs just before the commit (and
    may refuse it by raising). `table`: the one at `path`, loaded at its newest version by the caller.
    """
    table = DeltaTable(path) if table is None else table
    done = table.transaction_version(app_id)
    if done is not None and done >= version:
        return None
    files = _FileWriter(path, schema, stats_columns(table, schema))
    pending: list[pa.RecordBatch] = []
    pending_bytes = rows = 0
    for batch in batches:
        if batch.num_rows == 0:
            continue
        pending.append(batch)
        pending_bytes += batch.nbytes
        rows += batch.num_rows
        if pending_bytes >= ROW_GROUP_BYTES:
            files.write(pa.Table.from_batches(pending, schema))
            pending, pending_bytes = [], 0
    if pending:
        files.write(pa.Table.from_batches(pending, schema))
    files.close_file()
    if not files.actions:
        return 0
    if before_commit is not None:
        before_commit()
    _commit(table, files.actions, schema, app_id, version)
    return rows


def _commit(
    table: DeltaTable, actions: list[AddAction | RemoveAction], schema: pa.Schema, app_id: str, version: int,
    *, mode: str = "append", also: Iterable[tuple[str, int]] = (),
) -> None:
    table.create_write_transaction(
        actions, mode=mode, schema=schema,  # type: ignore[arg-type]
        commit_properties=CommitProperties(
            app_transactions=[Transaction(app_id, version), *(Transaction(a, v) for a, v in also)],
            max_commit_retries=COMMIT_RETRIES),
    )


def new_folder(prefix: str) -> str:
    """A folder of the table for files Spark writes: not hidden (no `_` or `.`), so that VACUUM deletes
    what a killed run left uncommitted, and new every time, so that a replay never meets a half-written one."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def commit_parquet_folder(
    path: str, schema: pa.Schema, folder: str, *, app_id: str, version: int, expect_rows: int | None = None,
    before_commit: Callable[[], None] | None = None, overwrite: bool = False,
    also: Iterable[tuple[str, int]] = (), files: Iterable[str] | None = None,
) -> int | None:
    """Commit the Parquet files that Spark wrote into `folder` of the table at `path` as Delta transaction
    (`app_id`, `version`), and the transactions `also` names in the same commit: the rows committed, or None if
    Delta holds that version already (nothing is committed; the files are left to VACUUM). `overwrite`: the files
    replace the table's rows (a whole build), in that one commit. `files`: those of the folder's files alone (the
    names the tasks that succeeded reported: a failed attempt's file is left to VACUUM), else every one there.

    Every file must have exactly the table's columns and types (`schema`), and together `expect_rows`
    rows when given: anything else is refused before the commit, so a wrong read never reaches the lake.
    """
    table = DeltaTable(path)
    done = table.transaction_version(app_id)
    if done is not None and done >= version and not overwrite:  # a whole build replaces, whatever was recorded
        return None
    fs, root = filesystem(path)
    if files is not None:
        names = sorted(f"{root}/{folder}/{name}" for name in files)
    else:
        infos = fs.get_file_info(pafs.FileSelector(f"{root}/{folder}", recursive=True))
        names = sorted(i.path for i in infos if i.is_file and i.base_name.endswith(".parquet")
                       and not i.base_name.startswith(("_", ".")))
    stats_names = stats_columns(table, schema)
    actions: list[AddAction | RemoveAction] = []
    rows = 0
    for name in names:
        with fs.open_input_file(name) as source:
            metadata = pq.ParquetFile(source).metadata
        found = metadata.schema.to_arrow_schema()
        if [(f.name, f.type) for f in found] != [(f.name, f.type) for f in schema]:
            raise ValueError(f"{name} does not have the table's columns and types: {found} instead of {schema}")
        stats = _Stats(stats_names)
        stats.add_footer(metadata)
        rows += stats.rows
        if stats.rows == 0:
            continue
        info = fs.get_file_info(name)
        actions.append(AddAction(
            path=name[len(root) + 1:], size=int(info.size), partition_values={},
            modification_time=int(time.time() * 1000), data_change=True, stats=stats.to_json(),
        ))
    if expect_rows is not None and rows != expect_rows:
        raise ValueError(f"Spark wrote {rows:,} rows into {path}/{folder}, {expect_rows:,} were counted: not committed")
    if not actions and not overwrite:
        return 0
    if before_commit is not None:
        before_commit()
    _commit(table, actions, schema, app_id, version, mode="overwrite" if overwrite else "append", also=also)
    return rows
