"""State history: `stream_state_<type>_history`, every state a stream of a type has been in (SCD type 2).

A reducer registered with `history=True` (or "daily") gives its stream type this table beside `stream_state`:
one row per state a stream has been in (with "daily", per day it changed: the state at the end of that day), with
its version range (`version_from`..`version_to`), `valid_from` (the running maximum of the stream's
`recorded_at` up to `version_to`: a transaction's start time can go backwards within a stream, the interval never
does) and `valid_to` (the next row's `valid_from`; NULL while current, when `is_current` is true), then the
state as JSON and, where the reducer declares it, one column per field as in the typed state table.

Made by the fold itself (lake/state/fold.py `StreamFold`: its trail), on every engine, and committed beside
`stream_state`'s commit, in its turn (after it in this process; before it on Spark, whose fold reads
`stream_state` and would be computed again once that is written):
- an increment closes each touched stream's current row (its `valid_to` set) and adds the new ones, in one
  MERGE per table; a "daily" row of the day already current replaces it (keeping its `valid_from`, the time
  of that day's first change). The table is partitioned by
  `is_current`, so the MERGE reads and rewrites only the current rows' files, as `stream_state`'s does;
- a first build, a stream type rebuilt (a revision, an upcaster), or a table not bound to `stream_state`'s
  last commit (turned on, its grain or fields changed, a crash between the two commits) is written whole
  from a fold of every event of its type (lake/state/stream_state.py rebuilds the type for it).

Each commit carries the Delta transaction id (`es_pipeline.stream_state_<type>_history@<events id>/<grain>`,
the txn version of the `stream_state` commit it follows): a table whose version is not `stream_state`'s is
rebuilt, never patched, so no state is missed or written twice. Untouched tables take an empty commit.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, write_deltalake

from es_pipeline.domain import Domain, Reducer
from es_pipeline.domain import load as load_domain
from es_pipeline.errors import DomainError, TypedStateMismatch
from es_pipeline.lake.delta import current, pieces, tables
from es_pipeline.lake.delta.definition import Table, spark_type
from es_pipeline.lake.delta.tables import UTC_MICROS, Location
from es_pipeline.lake.kernel import position
from es_pipeline.lake.state import state_json, typed_state
from es_pipeline.lake.state.fold import StreamFold

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

SUFFIX = "_history"
_ENVELOPE = pa.schema([
    ("tenant", pa.string()), ("stream_id", pa.string()), ("version_from", pa.int32()), ("version_to", pa.int32()),
    ("valid_from", UTC_MICROS), ("valid_to", UTC_MICROS), ("is_current", pa.bool_()), ("revision", pa.int32()),
    ("state", pa.string()),
])
KEY = ("tenant", "stream_id", "version_from")
PARTITION = ["is_current"]
# The fold's trail (lake/state/fold.py `StreamFold._history`): the current row it closes, then the rows it adds.
TRAIL_DDL = "STRUCT<c: INT, r: ARRAY<STRUCT<f: INT, t: INT, a: BIGINT, b: BIGINT, s: STRING>>>"


def table_name(stream_type: str) -> str:
    """`stream_state_<type>_history`, the type as its typed table names it."""
    return typed_state.table_name(stream_type) + SUFFIX


def history_tables(domain: Domain) -> dict[str, tuple[Reducer, Table]]:
    """Per stream type whose reducer keeps history: (the reducer, its table)."""
    typed = {table.name: t for t, (_, table) in typed_state.typed_tables(domain).items()}
    out: dict[str, tuple[Reducer, Table]] = {}
    named: dict[str, str] = {}
    for stream_type, reducer in sorted(domain.folds.items()):
        if reducer.history is None:
            continue
        name = table_name(stream_type)
        if name in typed:
            raise DomainError(f"stream type {typed[name]!r}'s typed table and {stream_type!r}'s history would both "
                              f"be {name}", "Rename a stream type, or keep the history of another.")
        if name in named:
            raise DomainError(f"stream types {named[name]!r} and {stream_type!r} would both keep their history in "
                              f"{name}", "Keep the history of one of them only, or rename a stream type.")
        named[name] = stream_type
        schema = pa.schema([*_ENVELOPE, *(reducer.state or [])])
        out[stream_type] = (reducer, Table(name, schema, key=KEY, comment=f"state history of the {stream_type} "
                                           f"streams ({'every state' if reducer.history == 'each' else reducer.history})"))
    return out


def app_id(table: Table, events_id: str, reducer: Reducer) -> str:
    """The app id of `table`'s commits: bound to the `events` table and to the grain (a new grain: built whole)."""
    return app_id_of(table.name, events_id, reducer.history or "")


def app_id_of(name: str, events_id: str, grain: str) -> str:
    """`app_id` by the table's name and a grain ("each", "daily:<zone>")."""
    return f"es_pipeline.{name}@{events_id}/{grain}"


def grains_of(modules: Iterable[str]) -> list[str]:
    """The grains a history table's app id may name: "each", "daily:UTC", and those the domain in `modules` keeps
    (where it loads; else the two)."""
    out = ["each", "daily:UTC"]
    try:
        domain = load_domain(tuple(modules))
    except Exception:  # noqa: BLE001 - no domain here: the two common grains, and an unbound table is rebuilt
        return out
    return out + sorted({r.history for r in domain.reducers.values() if r.history and r.history not in out})


def unbound(warehouse: Location, domain: Domain, events_id: str, read: int, stale: Collection[str] = ()) -> list[str]:
    """The stream types whose history table does not follow `stream_state`'s last commit (txn version `read`): none
    yet, another grain, or behind (a crash between the two commits). Their types are folded again, the tables
    written whole. A table that follows it but whose declared fields changed (its type not `stale`: not rebuilt
    anyway) has its columns made again from its own `state` here, in batches, under the same transaction id (no
    refold); where an old state does not fit the new fields, its type is folded again instead."""
    out = []
    for stream_type, (reducer, table) in history_tables(domain).items():
        path = table.path(warehouse)
        if not tables.is_delta_table(path):
            out.append(stream_type)
            continue
        held = DeltaTable(path)
        app = app_id(table, events_id, reducer)
        if held.transaction_version(app) != read:
            out.append(stream_type)
        elif stream_type not in stale and not _same_columns(held, table) and not _retyped(path, held, reducer, table,
                                                                                            app, read):
            out.append(stream_type)
    return out


def _retyped(path: str, held: DeltaTable, reducer: Reducer, table: Table, app: str, read: int) -> bool:
    """The table written again with the declared fields' columns made from each row's `state`, batch by batch
    (`is_current` from `valid_to`: a partition column is not in the files); False, nothing committed, where a state
    does not fit them."""

    misfit: list[TypedStateMismatch] = []

    def batches() -> Any:
        for batch in pieces.batches(path, held, [n for n in _ENVELOPE.names if n != "is_current"]):
            rows = pa.Table.from_batches([batch])
            rows = rows.append_column("is_current", pc.is_null(rows["valid_to"]))
            try:
                typed = _with_fields(rows, reducer, table)
            except TypedStateMismatch as exc:
                misfit.append(exc)
                raise
            yield from typed.to_batches()

    try:
        write_deltalake(path, pa.RecordBatchReader.from_batches(table.schema, batches()), mode="overwrite",
                        schema_mode="overwrite", partition_by=PARTITION, commit_properties=position.commit_properties(app, read))
    except Exception:  # the misfit comes back through Arrow's reader, wrapped or not: anything else re-raises
        if misfit:
            return False
        raise
    return True


def _same_columns(held: DeltaTable, table: Table) -> bool:
    schema = current.plain_schema(pa.schema(held.schema().to_arrow()))
    return [(f.name, f.type) for f in schema] == [(f.name, f.type) for f in table.schema]


def write_arrow(warehouse: Location, domain: Domain, out: pa.Table, events_id: str, version: int,
                whole: Collection[str] | None, skip: Collection[str] = ()) -> dict[str, int]:
    """The history tables of `domain` after the fold `out` (lake/state/fold.py `FOLD_OUT`), committed by delta-rs at
    txn `version`; `whole`: the stream types rebuilt (their tables written whole), None: every one; `skip`: the
    types whose tables are left as they are (being rebuilt beside, lake/state/rebuild.py). Rows per table."""
    written: dict[str, int] = {}
    for stream_type, (reducer, table) in history_tables(domain).items():
        if stream_type in skip:
            continue
        path = table.path(warehouse)
        props = position.commit_properties(app_id(table, events_id, reducer), version)
        of_type = out.filter(pc.and_(pc.equal(out["stream_type"], stream_type), pc.is_valid(out["history"])))
        rows, closes = _rows(of_type, reducer, table)
        if whole is None or stream_type in whole or not tables.is_delta_table(path):
            write_deltalake(path, rows, mode="overwrite", schema_mode="overwrite", partition_by=PARTITION,
                            commit_properties=props, description=f"es_pipeline: {table.comment}")
        elif rows.num_rows:
            _merge(DeltaTable(path), rows, closes, props)
        else:
            position.record(DeltaTable(path), props, partition_by=PARTITION)
        written[table.name] = rows.num_rows
    return written


def write_built(warehouse: Location, domain: Domain, built: dict[str, list[pa.Table]], events_id: str,
                version: int) -> dict[str, int]:
    """A whole build's history tables, from the rows the folding processes made (`built_rows`, per stream type),
    each written whole by delta-rs at txn `version`. Rows per table."""
    written: dict[str, int] = {}
    for stream_type, (reducer, table) in history_tables(domain).items():
        parts = built.get(stream_type) or []
        rows = pa.concat_tables(parts) if parts else table.schema.empty_table()
        write_deltalake(table.path(warehouse), rows, mode="overwrite", schema_mode="overwrite", partition_by=PARTITION,
                        commit_properties=position.commit_properties(app_id(table, events_id, reducer), version),
                        description=f"es_pipeline: {table.comment}")
        written[table.name] = rows.num_rows
    return written


def rows_of(out: pa.Table, reducer: Reducer, table: Table) -> pa.Table:
    """The history rows of a first fold's output `out` (lake/state/fold.py `FOLD_OUT`, its trails) for the stream type
    of `reducer` (its table `table`)."""
    of_type = out.filter(pc.and_(pc.equal(out["stream_type"], reducer.stream_type), pc.is_valid(out["history"])))
    return _rows(of_type, reducer, table)[0]


def _rows(of_type: pa.Table, reducer: Reducer, table: Table) -> tuple[pa.Table, pa.Table]:
    """The trails of one stream type's folded streams as the history table's rows, and the current rows they close
    ((tenant, stream_id, version_from) with their new `valid_to`)."""
    rows: dict[str, list[Any]] = {name: [] for name in _TRAIL_COLUMNS}
    closes: dict[str, list[Any]] = {"tenant": [], "stream_id": [], "version_from": [], "valid_to": []}
    for tenant, sid, revision, text in zip(*(of_type[c].to_pylist() for c in (
            "tenant", "stream_id", "revision", "history")), strict=True):
        trail = orjson.loads(text)
        if trail["c"] is not None:
            for k, v in zip(closes, (tenant, sid, trail["c"], trail["r"][0]["a"]), strict=True):
                closes[k].append(v)
        for r in trail["r"]:
            for k, v in zip(rows, (tenant, sid, r["f"], r["t"], r["a"], r["b"], r["s"], revision), strict=True):
                rows[k].append(v)
    envelope = _envelope(rows)
    closed = pa.table({"tenant": pa.array(closes["tenant"], pa.string()),
                       "stream_id": pa.array(closes["stream_id"], pa.string()),
                       "version_from": pa.array(closes["version_from"], pa.int32()),
                       "valid_to": pa.array(closes["valid_to"], pa.int64()).cast(UTC_MICROS)})
    return _with_fields(envelope, reducer, table), closed


def built_rows(folds: Iterable[StreamFold], reducer: Reducer, table: Table) -> pa.Table:
    """The history rows of streams folded from their first event (a whole build, in the process that folded
    them: no trail goes through JSON), declared fields included."""
    rows = [(fold.tenant, fold.stream_id, *row) for fold in folds for row in fold.history_rows()]
    if not rows:
        return table.schema.empty_table()
    tenant, stream_id, version_from, version_to, valid_from, valid_to, state = zip(*rows, strict=True)
    return _with_fields(_envelope({
        "tenant": tenant, "stream_id": stream_id, "version_from": version_from, "version_to": version_to,
        "valid_from": valid_from, "valid_to": valid_to, "state": state, "revision": [reducer.revision] * len(rows)}),
        reducer, table)


_TRAIL_COLUMNS = ("tenant", "stream_id", "version_from", "version_to", "valid_from", "valid_to", "state", "revision")


def _envelope(rows: dict[str, Any]) -> pa.Table:
    valid_to = pa.array(rows["valid_to"], pa.int64())
    return pa.Table.from_arrays([
        pa.array(rows["tenant"], pa.string()), pa.array(rows["stream_id"], pa.string()),
        pa.array(rows["version_from"], pa.int32()), pa.array(rows["version_to"], pa.int32()),
        pa.array(rows["valid_from"], pa.int64()).cast(UTC_MICROS), valid_to.cast(UTC_MICROS), pc.is_null(valid_to),
        pa.array(rows["revision"], pa.int32()), pa.array(rows["state"], pa.string())], schema=_ENVELOPE)


def _with_fields(envelope: pa.Table, reducer: Reducer, table: Table) -> pa.Table:
    """History rows (`_ENVELOPE`) with the declared fields' columns, from each row's `state`."""
    fields: list[pa.ChunkedArray | pa.Array] = []
    if reducer.state is not None:
        try:
            fields = state_json.columns([_parsed(s) for s in envelope["state"].to_pylist()], reducer.state).columns
        except state_json.StateMisfit as misfit:
            raise TypedStateMismatch(reducer.stream_type, envelope["stream_id"][misfit.index].as_py(), misfit.field,
                                     misfit.value, misfit.reason) from None
    return pa.Table.from_arrays([*envelope.select(_ENVELOPE.names).cast(_ENVELOPE).columns, *fields],
                                schema=table.schema)


def _parsed(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)  # what orjson refuses (integers past 64 bits, NaN): the fold wrote it so


def _merge(target: DeltaTable, rows: pa.Table, closes: pa.Table, props: CommitProperties) -> None:
    """New rows inserted (or, daily, replacing the current row of their day) and the rows they supersede closed,
    in one commit; only the current rows' partition is read and rewritten."""
    source = pa.concat_tables([
        rows.append_column("es_close", pa.array([False] * rows.num_rows, pa.bool_())),
        _close_rows(closes, rows.schema).append_column("es_close", pa.array([True] * closes.num_rows, pa.bool_())),
    ])
    every = {c: f"u.{c}" for c in rows.column_names}
    replaced = {c: v for c, v in every.items() if c != "valid_from"}  # a day's row keeps its first change's time
    on = " AND ".join(f"t.{k} = u.{k}" for k in KEY)
    target.merge(source, predicate=f"t.is_current = true AND {on}", source_alias="u", target_alias="t",
                 commit_properties=props) \
        .when_matched_update(updates={"valid_to": "u.valid_to", "is_current": "false"}, predicate="u.es_close") \
        .when_matched_update(updates=replaced, predicate="NOT u.es_close") \
        .when_not_matched_insert(updates=every, predicate="NOT u.es_close").execute()


def _close_rows(closes: pa.Table, schema: pa.Schema) -> pa.Table:
    """`closes` with the history table's columns (NULL where a close says nothing)."""
    return pa.table({f.name: closes[f.name] if f.name in closes.column_names else pa.nulls(closes.num_rows, f.type)
                     for f in schema}, schema=schema)


def write_spark(spark: SparkSession, warehouse: Location, domain: Domain, folded: Any, events_id: str, version: int,
                whole: Collection[str], skip: Collection[str] = ()) -> dict[str, int]:
    """As `write_arrow`, from Spark's fold (`folded`, cached) and by Spark: MERGE, or the table written whole."""
    from pyspark.sql import functions as F

    written: dict[str, int] = {}
    for stream_type, (reducer, table) in history_tables(domain).items():
        if stream_type in skip:
            continue
        path = table.path(warehouse)
        app = app_id(table, events_id, reducer)
        trails = folded.where((F.col("stream_type") == stream_type) & F.col("history").isNotNull()) \
            .select("tenant", "stream_id", "revision", F.from_json("history", TRAIL_DDL).alias("h"))
        rows = trails.select("tenant", "stream_id", "revision", F.explode("h.r").alias("r")).select(
            "tenant", "stream_id", F.col("r.f").alias("version_from"), F.col("r.t").alias("version_to"),
            F.timestamp_micros("r.a").alias("valid_from"), F.timestamp_micros("r.b").alias("valid_to"),
            F.col("r.b").isNull().alias("is_current"), "revision", F.col("r.s").alias("state"))
        if reducer.state is not None:
            declared = ", ".join(f"`{f.name}`: {spark_type(f.type)}" for f in reducer.state)
            rows = rows.withColumn("_typed", F.from_json("state", f"STRUCT<{declared}>")) \
                .select(*_ENVELOPE.names, *(F.col(f"_typed.`{f.name}`").alias(f.name) for f in reducer.state))
        rows = rows.cache()
        try:
            n = rows.count()
            if stream_type in whole or not tables.is_delta_table(path):
                (rows.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
                 .partitionBy(*PARTITION).option("txnAppId", app).option("txnVersion", str(version)).save(path))
            elif n:
                closes = trails.where(F.col("h.c").isNotNull()).select(
                    "tenant", "stream_id", F.col("h.c").alias("version_from"),
                    F.timestamp_micros(F.col("h.r")[0]["a"]).alias("valid_to"))
                _merge_spark(spark, path, rows, closes, app, version)
            else:
                # Nothing of its type: an empty commit records the version.
                position.record(DeltaTable(path), position.commit_properties(app, version), partition_by=PARTITION)
        finally:
            rows.unpersist()
        written[table.name] = n
    return written


def _merge_spark(spark: SparkSession, path: str, rows: Any, closes: Any, app: str, version: int) -> None:
    from pyspark.sql import functions as F

    source = rows.withColumn("es_close", F.lit(False)).unionByName(
        closes.withColumn("es_close", F.lit(True)), allowMissingColumns=True)
    on = " AND ".join(f"t.{k} = u.{k}" for k in KEY)
    every = ", ".join(f"`{c}` = u.`{c}`" for c in rows.columns if c != "valid_from")  # as in `_merge`
    with tables.spark_merge_source(spark, source, path, app, version) as view:
        spark.sql(
            f"MERGE INTO delta.`{path}` t USING {view} u ON t.is_current = true AND {on} "
            f"WHEN MATCHED AND u.es_close THEN UPDATE SET valid_to = u.valid_to, is_current = false "
            f"WHEN MATCHED THEN UPDATE SET {every} "
            f"WHEN NOT MATCHED AND NOT u.es_close THEN INSERT ({', '.join(f'`{c}`' for c in rows.columns)}) "
            f"VALUES ({', '.join(f'u.`{c}`' for c in rows.columns)})")


def table_names(warehouse: Location) -> list[str]:
    """The history tables in the lake now (whatever the domain)."""
    return [n for n in tables.table_names(warehouse, typed_state.PREFIX) if n.endswith(SUFFIX)]
