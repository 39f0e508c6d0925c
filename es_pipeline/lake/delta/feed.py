"""Reading Delta tables without a JVM: `events`' change feed since a version, a table's files, its row count.

What the Arrow paths of every table share (lake/state/stream_state.py, lake/aggregates/aggregate.py, lake/state/snapshots.py): the
rows that the `events` commits after a version added, read by delta-rs from Delta's change data feed (which
leaves out compaction's rewrites); a table's current files as one pyarrow dataset; the Delta transaction
an update commits with.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import CommitProperties, DeltaTable, Transaction

from es_pipeline.lake.delta import tables

log = logging.getLogger(__name__)

SMALL_INCREMENT = 200_000  # new events at most; above, Spark does the update


def new_rows(events: DeltaTable, after: int, upto: int, columns: list[str], *, whole: bool = False,
             predicate: str | None = None) -> pa.Table | None:
    """The rows that the `events` commits after..upto (inclusive) added (`columns` may name `_commit_version`), or
    None when they cannot be read (their files vacuumed or purged) or, unless `whole`, number more than
    `SMALL_INCREMENT`: then Spark takes the update, or the table is built anew. `predicate`: only the rows it
    keeps (SQL over the table's columns), filtered as the feed is read."""
    limit = None if whole else SMALL_INCREMENT
    try:
        feed = pa.RecordBatchReader.from_stream(events.load_cdf(
            starting_version=after + 1, ending_version=upto, columns=[*columns, "_change_type"], predicate=predicate))
        batches, rows = [], 0
        for batch in feed:
            rows += batch.num_rows
            if limit is not None and rows > limit:
                return None
            batches.append(batch)
    except Exception as exc:  # noqa: BLE001 - a vacuumed file goes to Spark's rebuild; anything else re-raises
        if tables.change_feed_gone(exc):
            return None
        raise
    table = plain(pa.Table.from_batches(batches, schema=feed.schema))
    return table.filter(pc.equal(table["_change_type"], "insert")).select(columns)


class Feed:
    """`events`' change feed up to its version now, read once for several increments (a tailing run folds
    the three projections one after another, usually from the same version): each asks for the rows after
    its own version, in its own columns. The table's log is loaded once."""

    def __init__(self, events_path: str, columns: list[str]) -> None:
        self.table, self.columns = DeltaTable(events_path), list(dict.fromkeys(columns))
        self.version = self.table.version()
        self.table_id = str(self.table.metadata().id)  # which `events` (lake/delta/definition.py `over`)
        self._after: int | None = None
        self._rows: pa.Table | None = None

    def rows(self, after: int, columns: list[str]) -> pa.Table | None:
        """The rows the commits after..version added (None: more than `SMALL_INCREMENT`, or vacuumed)."""
        if self._after is None or after < self._after:
            self._after = after
            self._rows = new_rows(self.table, after, self.version, [*self.columns, "_commit_version"])
        if self._rows is None:
            return None
        rows = self._rows
        if after > self._after:
            rows = rows.filter(pc.greater(rows["_commit_version"], after))
        return rows.select(columns)


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


def commit_properties(app_id: str, version: int) -> CommitProperties:
    return CommitProperties(app_transactions=[Transaction(app_id, version)])


FENCE = 2**62  # a position past any `events` version


def fence_older(path: str, positions: Sequence[tuple[str, int]]) -> None:
    """Before a whole build of a table that an older es_pipeline kept under unbound app ids (lake/delta/definition.py `over`):
    those ids set to `positions` (FENCE: "nothing new"), so that an older release still running (a tailing run
    started before the upgrade) finds nothing to fold there, rather than merging its increments from its old
    position onto the rows rebuilt; its update under way finds its position moved and commits nothing
    (lake/delta/serial.py `confirm`). A table without them (new, or fenced already) is left as it is."""
    if not tables.is_delta_table(path):
        return
    table = DeltaTable(path)
    todo = [(a, v) for a, v in positions if (held := table.transaction_version(a)) is not None and held != v]
    if not todo:
        return
    try:
        table.create_write_transaction([], mode="append", schema=table.schema(), commit_properties=CommitProperties(
            app_transactions=[Transaction(a, v) for a, v in todo]))
    except Exception as exc:  # noqa: BLE001 - a table delta-rs will not write (its features): the build goes on
        log.warning("%s: could not fence the positions of an older es_pipeline (%s)", path, exc)


def has_deletion_vectors(table: DeltaTable) -> bool:
    """Whether the table may mark rows deleted without rewriting their files: then its files alone are not its rows."""
    return "deletionVectors" in (table.protocol().writer_features or [])
