"""`events`' change feed: the rows its commits added after a version, read by delta-rs from Delta's change data
feed (which leaves out compaction's rewrites). `Feed` reads it once for every table a tailing run folds.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.current import plain

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
        self.table = DeltaTable(events_path)
        self.columns = [c for c in dict.fromkeys(columns) if c != "_commit_version"]  # read with every row anyway
        self.version = self.table.version()
        self.table_id = str(self.table.metadata().id)  # which `events` (lake/delta/definition.py `over`)
        self._after: int | None = None
        self._rows: pa.Table | None = None

    def none(self, columns: list[str]) -> pa.Table:
        """No rows, in `columns` (`_commit_version` among them where named): an increment of nothing (a retry)."""
        schema = plain(pa.schema(self.table.schema().to_arrow()).empty_table()).schema
        fields = [schema.field(c) if c in schema.names else pa.field(c, pa.int64()) for c in columns]
        return pa.schema(fields).empty_table()

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
