"""The typed event tables' whole build on Spark: two jobs over `events`, however many types; the driver decides.

1. **Shapes**: on the executors, each partition's rows of each type give the (column, type) pairs their payloads
   bring, in order (`typed_rows.column_types`); the driver replays every partition's pairs in the lake's order (by
   each one's first global position, `typed_rows.grow`): each table's columns as one batch of all its rows would
   have them.
2. **Placed**: on the executors again, each partition's rows of each type typed against those columns
   (`typed_rows.type_rows`, which then widens nothing: a batch that would is a fault, raised) and written as
   Parquet into a new folder of the type's table, a file per type per task; each task hands back one row per file
   (its rows, the values it kept in `_overflow`, each column's first value's time). delta-rs commits each table's
   files, those the succeeding tasks named, with the table's transaction id (lake/typed/event_tables.py): the
   lake's commit rule (docs/decisions/0024-object-storage-and-cluster.md).

The executors write with pyarrow's filesystem of the lake (a folder, or object storage with the credentials
delta-rs has: the `AWS_*` variables or the machine's role), since one Spark writer cannot give each of hundreds
of tables its own columns in one job. The rows are those of the in-process build, by the rule's promise
(lake/typed/shapes.py: the same table whatever the batches were).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from es_pipeline.domain import Domain
from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.definition import spark_type
from es_pipeline.lake.typed import shapes
from es_pipeline.lake.typed.typed_rows import (
    ENVELOPE,
    by_type,
    column_types,
    grow,
    payload_columns,
    type_rows,
    upcasting,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_SHAPES = pa.schema([("event_type", pa.string()), ("first_position", pa.int64()), ("pairs", pa.binary())])
_FILES = pa.schema([("event_type", pa.string()), ("file", pa.string()), ("rows", pa.int64()),
                    ("overflowed", pa.int64()), ("first_at", pa.string())])
FLUSH_ROWS = 250_000  # a type's typed rows a task holds before it writes them as a file


def _ddl(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name} {spark_type(f.type)}" for f in schema)


def source(spark: SparkSession, events_path: str, version: int, read: list[str]) -> Any:
    """`events`' rows at `version`, the columns of `read` it has, as a Spark DataFrame."""
    df = tables.read(spark, events_path, version=version)
    held = set(df.columns)
    return df.select(*(c for c in read if c in held))


def shapes_of(events: Any, domain: Domain) -> dict[str, dict[str, pa.DataType]]:
    """Each event type's payload columns over every row of `events` (a DataFrame): the partitions' pairs replayed
    in the lake's order (by the first global position of each)."""
    found = events.mapInArrow(_shapes(domain), _ddl(_SHAPES)).collect()
    columns: dict[str, dict[str, pa.DataType]] = {}
    for row in sorted(found, key=lambda r: (r["event_type"], r["first_position"] if r["first_position"] is not None
                                             else -1)):
        kind = row["event_type"]
        held, fixed = payload_columns(None, domain.event_schemas.get(kind))
        columns.setdefault(kind, held)
        grow(columns[kind], [(f.name, f.type) for f in pa.ipc.read_schema(pa.py_buffer(row["pairs"]))], fixed)
    return columns


def _shapes(domain: Domain) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """For `mapInArrow`: one row per event type of a partition, with the pairs its payloads bring."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        part = pa.Table.from_batches(list(batches))
        found = []
        for kind, rows in by_type(part, domain):
            pairs = column_types(rows, domain=upcasting(domain, kind), declared=domain.event_schemas.get(kind))
            first = pc.min(rows["global_position"]).as_py() if "global_position" in rows.column_names else None
            found.append({"event_type": kind, "first_position": first,
                          "pairs": pa.schema([pa.field(c, t) for c, t in pairs]).serialize().to_pybytes()})
        if found:
            yield pa.RecordBatch.from_pylist(found, schema=_SHAPES)

    return run


def schema_of(columns: dict[str, pa.DataType]) -> pa.Schema:
    """A typed table's schema: the envelope, then its payload columns."""
    return pa.schema([*ENVELOPE, *(pa.field(c, t) for c, t in columns.items())])


@dataclass
class Placed:
    """What the tasks wrote for one table: its files (names in the folder), rows, the values kept in `_overflow`,
    each column's first value's time."""

    files: list[str] = field(default_factory=list)
    rows: int = 0
    overflowed: int = 0
    first_at: dict[str, datetime | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Target:
    """Where one event type's rows go: its table's path, the folder the build writes there, its schema."""

    path: str
    folder: str
    schema: pa.Schema


def place(events: Any, domain: Domain, targets: dict[str, Target]) -> dict[str, Placed]:
    """Every row of `events` (a DataFrame) typed and written by the executors into its type's target folder; what
    was written, per event type, from the rows the succeeding tasks handed back."""
    plan = {kind: (t.path, t.folder, t.schema.serialize().to_pybytes()) for kind, t in targets.items()}
    placed: dict[str, Placed] = {kind: Placed() for kind in targets}
    earliest: dict[str, int | None] = {}
    for row in events.mapInArrow(_place(domain, plan), _ddl(_FILES)).collect():
        got = placed[row["event_type"]]
        got.files.append(row["file"])
        got.rows += int(row["rows"])
        got.overflowed += int(row["overflowed"])
        firsts = json.loads(row["first_at"])
        for column, micros in firsts.items():
            held = got.first_at.get(column)
            if micros is not None:
                at = _at(micros)
                got.first_at[column] = at if held is None or at < held else held
            else:
                got.first_at.setdefault(column, None)
        low = firsts.get("", None)
        if low is not None and (earliest.get(row["event_type"]) is None or low < earliest[row["event_type"]]):
            earliest[row["event_type"]] = low
    for kind, got in placed.items():  # a column without a value: the time of the table's first event (as in process)
        low = earliest.get(kind)
        got.first_at = {c: at if at is not None else (None if low is None else _at(low))
                        for c, at in got.first_at.items() if c}
    return placed


def _at(micros: int) -> datetime:
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=micros)


def _place(domain: Domain, plan: dict[str, tuple[str, str, bytes]]) -> Callable[[Iterator[pa.RecordBatch]],
                                                                                Iterator[pa.RecordBatch]]:
    """For `mapInArrow`: a partition's rows typed per type and written as Parquet files, one row back per file."""
    schemas = {kind: pa.ipc.read_schema(pa.py_buffer(raw)) for kind, (_, _, raw) in plan.items()}

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        held: dict[str, list[pa.Table]] = {}
        overflowed: dict[str, int] = {}
        for batch in batches:
            for kind, rows in by_type(pa.Table.from_batches([batch]), domain):
                schema = schemas[kind]
                typed = type_rows(rows, schema, domain=upcasting(domain, kind), declared=domain.event_schemas.get(kind))
                if typed.added or typed.widened or typed.rows.schema.names != schema.names:
                    raise RuntimeError(f"typed event table of {kind!r}: a batch brought columns "
                                       f"{typed.added or list(typed.widened)} the build's first pass did not find")
                held.setdefault(kind, []).append(typed.rows.cast(schema))
                overflowed[kind] = overflowed.get(kind, 0) + typed.overflowed
                if sum(t.num_rows for t in held[kind]) >= FLUSH_ROWS:
                    yield _written(kind, plan[kind], held.pop(kind), overflowed.pop(kind))
        for kind, parts in held.items():
            yield _written(kind, plan[kind], parts, overflowed.get(kind, 0))

    return run


def _written(kind: str, where: tuple[str, str, bytes], parts: list[pa.Table], overflowed: int) -> pa.RecordBatch:
    """`parts` (one type's typed rows) written as one Parquet file into the type's folder; its row for the driver."""
    path, folder, _ = where
    rows = pa.concat_tables(parts)
    name = f"part-{uuid.uuid4().hex}.parquet"
    fs, root = tables.filesystem(f"{path}/{folder}")
    fs.create_dir(root, recursive=True)
    pq.write_table(rows, f"{root}/{name}", filesystem=fs, compression="snappy")
    recorded = rows["recorded_at"].cast(pa.int64())
    firsts: dict[str, int | None] = {"": pc.min(recorded).as_py()}
    for f in rows.schema:
        if f.name not in ENVELOPE.names or f.name == shapes.OVERFLOW:
            valid = pc.is_valid(rows[f.name])
            firsts[f.name] = pc.min(recorded.filter(valid)).as_py() if pc.any(valid).as_py() else None
    return pa.RecordBatch.from_pylist([{"event_type": kind, "file": name, "rows": rows.num_rows,
                                        "overflowed": overflowed, "first_at": json.dumps(firsts)}], schema=_FILES)
