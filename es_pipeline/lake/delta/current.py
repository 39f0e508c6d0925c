"""A Delta table as it stands, read without a JVM: its current files as one pyarrow dataset, its row count, whether
it marks rows deleted, and delta-rs's strings made plain for pyarrow's kernels.

What the Arrow paths of every table share; the change feed of `events` is the kernel's (lake/kernel/feed.py).
"""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import DeltaTable

from es_pipeline.lake.delta import tables

log = logging.getLogger(__name__)

def plain(table: pa.Table) -> pa.Table:
    """delta-rs reads strings as `string_view`, which pyarrow's kernels do not all take: plain strings."""
    return table.cast(plain_schema(table.schema))


def plain_schema(schema: pa.Schema) -> pa.Schema:
    return pa.schema([pa.field(f.name, pa.string(), f.nullable) if f.type == pa.string_view() else f for f in schema])


def files(path: str, table: DeltaTable) -> ds.Dataset:
    """The table's current Parquet files as a pyarrow dataset of one schema (plain strings)."""
    fs, _ = tables.filesystem(path)
    names = [tables.without_scheme(uri) for uri in table.file_uris()]
    # One schema for every file, with plain strings: delta-rs writes string_view into its files' Arrow schema.
    return ds.dataset(names, format="parquet", filesystem=fs, schema=plain_schema(pa.schema(table.schema().to_arrow())))


def row_count(table: DeltaTable) -> int:
    adds = pa.table(table.get_add_actions(flatten=True))
    return int(pc.sum(adds["num_records"]).as_py() or 0) if adds.num_rows else 0


def exact_row_count(table: DeltaTable) -> int | None:
    """The table's rows as its log says them, where that is exact: every file with its count of records, and no row
    marked deleted (a file's count is of all its rows); else None (then count them)."""
    if has_deletion_vectors(table):
        return None
    adds = pa.table(table.get_add_actions(flatten=True))
    if not adds.num_rows:
        return 0
    if "num_records" not in adds.column_names or adds["num_records"].null_count:
        return None
    return int(pc.sum(adds["num_records"]).as_py() or 0)


def has_deletion_vectors(table: DeltaTable) -> bool:
    """Whether the table may mark rows deleted without rewriting their files: then its files alone are not its rows."""
    return "deletionVectors" in (table.protocol().writer_features or [])
