"""The typed event tables' whole build on Spark: the executors read, type and write; the driver only decides.

Three steps, each one Spark job over the lake (or one per table), nothing of `events` through the driver:

1. **Staged**: `events`' rows at the version read, written once as Parquet partitioned by the table each goes to
   (`_table=events_item_added/`), so that each table's step reads its own rows alone.
2. **Shapes**: each partition's rows of each type give the (column, type) pairs their payloads bring, in order
   (`typed_rows.column_types`); the driver replays every partition's pairs in the lake's order (`typed_rows.grow`):
   each table's columns as a single batch of all its rows would have them.
3. **Placed**: each table's rows typed against those columns on the executors (`typed_rows.type_rows`, which then
   widens nothing) and written as Parquet into the table's folder, for delta-rs to commit (the lake's commit rule,
   docs/decisions/0024-object-storage-and-cluster.md).

The rows are those of the in-process build, by the rule's promise (lake/typed/shapes.py: the same table whatever
the batches were); lake/typed/event_tables.py commits them with the same transaction ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

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

TABLE = "_table"  # the staged rows' partition column: the typed table each goes to
_SHAPES_DDL = "event_type STRING, first_position BIGINT, pairs BINARY"


def stage(spark: Any, events_path: str, version: int, read: list[str], names: Callable[[str], str | None],
          folder: str) -> list[str]:
    """`events`' rows at `version` (the columns of `read` it has) written to `folder`, partitioned by the table
    `names` gives each raw event type (None: no table, left out); the tables, by name."""
    from pyspark.sql import functions as F

    df = tables.read(spark, events_path, version=version)
    kinds = [r[0] for r in df.select("event_type").distinct().collect() if r[0] is not None]
    routes = {kind: name for kind in kinds if (name := names(kind)) is not None}
    if not routes:
        return []
    route = F.create_map(*(F.lit(x) for kind, name in sorted(routes.items()) for x in (kind, name)))
    held = set(df.columns)
    (df.select(*(c for c in read if c in held)).withColumn(TABLE, route[F.col("event_type")])
     .where(F.col(TABLE).isNotNull()).write.mode("error").partitionBy(TABLE).parquet(folder))
    return sorted(set(routes.values()))


def shapes_of(spark: Any, folder: str, domain: Domain) -> dict[str, dict[str, pa.DataType]]:
    """Each event type's payload columns over every staged row: the partitions' pairs replayed in the lake's order
    (by the first global position of each)."""
    declared = domain.event_schemas
    found = spark.read.parquet(folder).drop(TABLE).mapInArrow(_shapes(domain), _SHAPES_DDL).collect()
    columns: dict[str, dict[str, pa.DataType]] = {}
    for row in sorted(found, key=lambda r: (r["event_type"], r["first_position"] if r["first_position"] is not None
                                             else -1)):
        kind = row["event_type"]
        held, fixed = payload_columns(None, declared.get(kind))
        columns.setdefault(kind, held)
        pairs = pa.ipc.read_schema(pa.py_buffer(row["pairs"]))
        grow(columns[kind], [(f.name, f.type) for f in pairs], fixed)
    return columns


def _shapes(domain: Domain) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """For `mapInArrow`: one row per event type of a partition, with the pairs its payloads bring."""
    out = pa.schema([("event_type", pa.string()), ("first_position", pa.int64()), ("pairs", pa.binary())])

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        part = pa.Table.from_batches(list(batches))
        found = []
        for kind, rows in by_type(part, domain):
            pairs = column_types(rows, domain=upcasting(domain, kind), declared=domain.event_schemas.get(kind))
            first = pc.min(rows["global_position"]).as_py() if "global_position" in rows.column_names else None
            found.append({"event_type": kind, "first_position": first,
                          "pairs": pa.schema([pa.field(c, t) for c, t in pairs]).serialize().to_pybytes()})
        if found:
            yield pa.RecordBatch.from_pylist(found, schema=out)

    return run


def schema_of(columns: dict[str, pa.DataType]) -> pa.Schema:
    """A typed table's schema: the envelope, then its payload columns."""
    return pa.schema([*ENVELOPE, *(pa.field(c, t) for c, t in columns.items())])


@dataclass
class Placed:
    """What one table's step wrote: its rows, each column's first value's time, the values kept in `_overflow`."""

    rows: int
    first_at: dict[str, datetime | None] = field(default_factory=dict)
    overflowed: int = 0


def place(spark: Any, folder: str, name: str, event_type: str, schema: pa.Schema, domain: Domain,
          out: str) -> Placed:
    """Table `name`'s staged rows (of `event_type`) typed as `schema` on the executors and written as Parquet to
    `out`; what was written, read back from those files."""
    from pyspark.sql import functions as F

    spark.conf.set("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")  # as delta-rs writes them
    ddl = ", ".join(f"`{f.name}` {spark_type(f.type)}" for f in schema)
    staged = spark.read.parquet(f"{folder}/{TABLE}={name}")
    staged.mapInArrow(_place(event_type, schema, domain), ddl).write.mode("error") \
        .option("compression", "snappy").parquet(out)
    payload = [f.name for f in schema if f.name not in ENVELOPE.names or f.name == shapes.OVERFLOW]
    written = spark.read.parquet(out)
    stats = written.agg(
        F.count(F.lit(1)).alias("rows"),
        F.sum(F.when(F.col(shapes.OVERFLOW).isNotNull(),
                     F.size(F.json_object_keys(F.col(shapes.OVERFLOW)))).otherwise(0)).alias("overflowed"),
        F.min("recorded_at").alias("first"),
        *(F.min(F.when(F.col(f"`{c}`").isNotNull(), F.col("recorded_at"))).alias(f"at_{i}")
          for i, c in enumerate(payload)),
    ).first()
    return Placed(int(stats["rows"]), {c: stats[f"at_{i}"] or stats["first"] for i, c in enumerate(payload)},
                  int(stats["overflowed"] or 0))


def _place(event_type: str, schema: pa.Schema, domain: Domain) -> Callable[[Iterator[pa.RecordBatch]],
                                                                            Iterator[pa.RecordBatch]]:
    """For `mapInArrow`: a batch of one type's staged rows as its table holds them (`schema`, which holds every
    value's type already: a column the batch would add or widen is a fault, raised)."""
    upcaster, declared = upcasting(domain, event_type), domain.event_schemas.get(event_type)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            rows = tables.tenant_filled(pa.Table.from_batches([batch])) if "tenant" in batch.schema.names \
                else pa.Table.from_batches([batch])
            typed = type_rows(rows, schema, domain=upcaster, declared=declared)
            if typed.added or typed.widened or typed.rows.schema.names != schema.names:
                raise RuntimeError(f"typed event table of {event_type!r}: a batch brought columns "
                                   f"{typed.added or list(typed.widened)} its build did not see")
            yield from typed.rows.cast(schema).to_batches()

    return run
