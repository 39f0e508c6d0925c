"""A table's rows in bounded pieces: an in-process build holds one piece at a time, whatever the lake's size.

A build that reads `events` whole holds every event in memory, so its peak grows with the lake (issue 43
measured first builds at 2N/N = 1.5-1.9). By pieces it holds one piece, and what it made of those before.

- `batches`: a table's rows at the version loaded, streamed in batches (pyarrow over its files, or DataFusion
  where deletion vectors say some of their rows are gone), never all at once.
- `chunks`: those batches gathered a million rows at a time (for an aggregate that adds up as it goes).
- `spread`: those rows sent, in one pass, each to its piece (a number per row in [0, count): by slice span
  with `by_slice`, so a stream's events meet in one piece), as Arrow IPC files (lz4) in a temporary folder
  (`TMPDIR`), then read back one piece at a time. Of one piece (`count_for` says 1: up to `PIECE_BYTES` of
  Parquet) nothing is written: the rows are read whole, as before.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import DeltaTable

from es_pipeline.lake.delta import current

PIECE_BYTES = 64 * 1024 * 1024  # Parquet bytes of `events` a piece holds at most (some 5x that once read)
BATCH_ROWS = 131_072  # rows a scan yields at a time
CHUNK_ROWS = 1_048_576  # rows `chunks` gathers (a streaming aggregate's step)
SLICES = 1024
MAX_PIECES = 256  # a piece file open per piece while spreading: well within the usual 1024 open files


def count_for(parquet_bytes: int) -> int:
    """How many pieces a read of `parquet_bytes` of files is cut into: at most `MAX_PIECES` (files open at once
    while spreading; past 16 GiB the pieces grow instead)."""
    return min(MAX_PIECES, max(1, math.ceil(parquet_bytes / PIECE_BYTES)))


def schema(table: DeltaTable, columns: Sequence[str]) -> pa.Schema:
    """The schema of `batches`: the `columns` the table has, in that order (plain strings)."""
    fields = current.plain_schema(pa.schema(table.schema().to_arrow()))
    return pa.schema([fields.field(c) for c in columns if c in fields.names])


def batches(path: str, table: DeltaTable, columns: Sequence[str],
            where: ds.Expression | None = None) -> Iterator[pa.RecordBatch]:
    """The table's rows at the version loaded, the `columns` it has (plain strings), a batch at a time; only those
    `where` holds for, where given (a table with deletion vectors: every row)."""
    wanted = schema(table, columns).names
    if current.has_deletion_vectors(table):
        from deltalake import QueryBuilder

        reader = QueryBuilder().register("t", table).execute("SELECT " + ", ".join(f'"{c}"' for c in wanted) + " FROM t")
        for batch in pa.RecordBatchReader.from_stream(reader):
            yield batch.cast(current.plain_schema(batch.schema))
        return
    # One file and one batch ahead at most: the scan's own buffers stay a few batches, not a few files.
    yield from current.files(path, table).to_batches(columns=wanted, filter=where, batch_size=BATCH_ROWS,
                                                   fragment_readahead=1, batch_readahead=1)


def chunks(source: Iterable[pa.RecordBatch], rows: int | None = None) -> Iterator[pa.Table]:
    """`source`'s batches gathered into tables of about `rows` (`CHUNK_ROWS`) rows (the last one smaller)."""
    rows = rows or CHUNK_ROWS
    held: list[pa.RecordBatch] = []
    count = 0
    for batch in source:
        held.append(batch)
        count += batch.num_rows
        if count >= rows:
            yield pa.Table.from_batches(held)
            held, count = [], 0
    if held:
        yield pa.Table.from_batches(held)


def by_slice(count: int) -> Callable[[pa.RecordBatch], pa.Array]:
    """Each row's piece by its slice, `count` spans of as many slices: a stream's events in one piece."""
    return lambda batch: pc.divide(pc.multiply(batch["slice"].cast(pa.int64()), count), SLICES)


class Pieces:
    """The pieces `spread` made: `read(i)` is the i-th, all its rows (one piece: the rows read whole)."""

    def __init__(self, count: int, folder: str | None = None, whole: pa.Table | None = None) -> None:
        self.count, self._folder, self._whole = count, folder, whole

    def read(self, i: int) -> pa.Table:
        if self._whole is not None:
            return self._whole
        assert self._folder is not None
        with pa.OSFile(_piece_path(self._folder, i)) as source:  # not mapped: the piece is this process's to free
            return pa.ipc.open_file(source).read_all()


@contextmanager
def spread(source: Iterable[pa.RecordBatch], rows_schema: pa.Schema, count: int,
           piece_of: Callable[[pa.RecordBatch], pa.Array]) -> Iterator[Pieces]:
    """`source`'s rows (of `rows_schema`) in `count` pieces by `piece_of`; the folder is removed on leaving (the
    files take about the Parquet's bytes, lz4: `TMPDIR` needs that much room)."""
    if count <= 1:
        yield Pieces(1, whole=pa.Table.from_batches(list(source), schema=rows_schema))
        return
    folder = tempfile.mkdtemp(prefix="es_pipeline-pieces-")
    try:
        options = pa.ipc.IpcWriteOptions(compression="lz4")
        with ExitStack() as files:  # every writer closed, however the pass ends
            writers = [files.enter_context(pa.ipc.new_file(_piece_path(folder, i), rows_schema, options=options))
                       for i in range(count)]
            for batch in source:
                # The batch ordered by piece, then cut where the piece changes: one pass, whatever `count`.
                which = piece_of(batch)
                order = pc.sort_indices(which)
                ordered, which = batch.take(order), which.take(order)
                start = 0
                for run in pc.value_counts(which).to_pylist():  # in order of appearance: ascending
                    writers[run["values"]].write_batch(ordered.slice(start, run["counts"]))
                    start += run["counts"]
        yield Pieces(count, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _piece_path(folder: str, i: int) -> str:
    return os.path.join(folder, f"piece-{i:05d}.arrow")

