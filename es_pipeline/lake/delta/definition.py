"""`Table`: what defines a table es_pipeline keeps in the lake, once: its name, Arrow schema, key, app id.

Every table built from `events` is an instance: `stream_state` (lake/state/stream_state.py), the additive
aggregates (lake/aggregates/aggregate.py, lake/aggregates/builtin.py), `snapshots` (lake/state/snapshots.py). From the one Arrow
schema come Spark's DDL and delta-rs's schema alike, so that either engine creates the table the other reads.
The app id is the Delta transaction id its updates commit with (`txnAppId`): the `events` version folded
in, in the same commit as the rows (docs/architecture.md, "Tables"). It names the `events` table too (`over`:
its Delta id), so that a table built from one `events` never reads on from its position in another: the lake
rebuilt, `events` replaced, finds no version under the new id, and the table is built whole again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.tables import UTC_MICROS, Location

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_SPARK_TYPES = {
    pa.string(): "STRING", pa.int32(): "INT", pa.int64(): "BIGINT", pa.float64(): "DOUBLE", pa.bool_(): "BOOLEAN",
    pa.date32(): "DATE", UTC_MICROS: "TIMESTAMP",
}


@dataclass(frozen=True)
class Table:
    name: str
    schema: pa.Schema  # its columns in order; `tenant` last, where a table of a release before tenants took it
    key: tuple[str, ...]  # one row per key
    comment: str = ""
    properties: dict[str, str] = field(default_factory=dict)
    app: str = ""  # the app id its position is kept under, where not `es_pipeline.<name>`

    @property
    def app_id(self) -> str:
        return self.app or f"es_pipeline.{self.name}"

    def app_id_over(self, events_id: str) -> str:
        """The app id of this table's updates from the `events` table whose Delta id is `events_id`."""
        return over(self.app_id, events_id)

    @property
    def ddl(self) -> str:
        """The schema as Spark SQL's column list."""
        return ", ".join(f"{f.name} {spark_type(f.type)}" for f in self.schema)

    def path(self, warehouse: Location) -> str:
        return tables.table_path(warehouse, self.name)

    def ensure(self, spark: SparkSession, warehouse: Location, properties: dict[str, str] | None = None) -> str:
        """The table created by Spark if it is not there (race-safe), with `properties` beside its own; its path."""
        path = self.path(warehouse)
        tables.ensure_table(spark, path, self.ddl, comment=f"es_pipeline: {self.comment}",
                            properties={**self.properties, **(properties or {})})
        return path

    def ensure_arrow(self, warehouse: Location, properties: dict[str, str] | None = None) -> str:
        """The table created by delta-rs if it is not there (race-safe), with any column it lacks added; its path."""
        path = self.path(warehouse)
        tables.ensure_table_arrow(path, self.schema, comment=f"es_pipeline: {self.comment}",
                                  properties={**self.properties, **(properties or {})} or None)
        return path

    def transaction_version(self, warehouse: Location) -> int | None:
        """The last `events` version (or what the table's app id counts) committed with the table's rows, from
        the `events` table the warehouse holds now (None: not built from that one)."""
        events = tables.table_path(warehouse, "events")
        if not tables.is_delta_table(events):
            return None
        return tables.transaction_version(self.path(warehouse), self.app_id_over(tables.table_id(events)))


def over(app_id: str, events_id: str) -> str:
    """`app_id` bound to the `events` table of Delta id `events_id` (table ids are UUIDs, new at each creation)."""
    return f"{app_id}@{events_id}"


def spark_type(arrow: pa.DataType) -> str:
    """An Arrow type as Spark's DDL spells it (a declared state's structs, lists, maps and decimals too)."""
    if arrow in _SPARK_TYPES:
        return _SPARK_TYPES[arrow]
    if pa.types.is_struct(arrow):
        return "STRUCT<" + ", ".join(f"`{arrow.field(i).name}`: {spark_type(arrow.field(i).type)}"
                                     for i in range(arrow.num_fields)) + ">"
    if pa.types.is_list(arrow) or pa.types.is_large_list(arrow):
        return f"ARRAY<{spark_type(arrow.value_type)}>"
    if pa.types.is_map(arrow):
        return f"MAP<{spark_type(arrow.key_type)}, {spark_type(arrow.item_type)}>"
    if pa.types.is_decimal(arrow):
        return f"DECIMAL({arrow.precision}, {arrow.scale})"
    if pa.types.is_timestamp(arrow) and arrow.tz is None:
        return "TIMESTAMP_NTZ"
    names = {pa.int8(): "TINYINT", pa.int16(): "SMALLINT", pa.float32(): "FLOAT", pa.binary(): "BINARY"}
    if arrow in names:
        return names[arrow]
    raise TypeError(f"no Spark type for Arrow's {arrow}")


@dataclass(frozen=True)
class Reconciled:
    """A projection compared with `events` at the version it folded (like with like: events committed since wait
    for its next update and differ from nothing, so the check cannot flap)."""

    events_version: int | None  # the `events` version compared at; None: not built from the `events` held now
    keys_off: int = 0  # keys whose row is not what `events` at that version gives (missing, extra or other)
    examples: tuple[str, ...] = ()
    note: str = ""  # why nothing was compared, where nothing was
    engine: str = ""  # what compared: "local" (this process) or "spark"; "" where nothing was

    def metadata(self) -> dict[str, Any]:
        return {"keys_off": self.keys_off, "examples": ", ".join(self.examples) or "-",
                "events_version_folded": -1 if self.events_version is None else self.events_version,
                **({"engine": self.engine} if self.engine else {}), **({"note": self.note} if self.note else {})}


def rows_off(expected: pa.Table, actual: pa.Table, key: list[str]) -> tuple[int, tuple[str, ...]]:
    """How many keys' rows differ between two tables of the same columns (a key on one side only counts too), and
    up to five of those keys."""
    values = [c for c in expected.column_names if c not in key]
    actual = actual.select(expected.column_names).cast(expected.schema)
    joined = expected.join(actual.rename_columns([c if c in key else f"{c}__lake" for c in actual.column_names]),
                           key, join_type="full outer")
    off = pa.array([False] * joined.num_rows, pa.bool_())
    for c in values:
        a, b = joined[c], joined[f"{c}__lake"]
        differ = pc.or_(pc.fill_null(pc.not_equal(a, b), False), pc.xor(pc.is_null(a), pc.is_null(b)))
        off = pc.or_(off, differ)
    bad = joined.filter(off)
    label = [" ".join(str(v) for v in row.values()) for row in bad.select(key).slice(0, 5).to_pylist()]
    return bad.num_rows, tuple(label)

