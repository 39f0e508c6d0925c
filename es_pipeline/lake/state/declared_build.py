"""`stream_state`'s first build of declared reducers (es_pipeline/declared.py) as DuckDB aggregations, with no
Python call per event.

Within the engine rule's bound a first build folds every event here (lake/state/whole_fold.py). For a stream type
whose reducer is declared, that fold is one `GROUP BY` per stream type over the same version of `events` (its Arrow
dataset, read by DuckDB): per field the aggregation it declares, in version order (`arg_max`/`arg_min` by version,
a decimal `sum`, a `count`), each with its event types as a `FILTER`; the state made as JSON in the query, keys
sorted, nulls left out, as the Python fold writes it. The rows are the fold's output (`FOLD_OUT`), as
`StreamFold.row` makes them.

Exactly the Python fold, or the Python fold itself: a stream is built natively only where the aggregation is the
fold's answer by construction. Its versions are 1..n with none missing (else the Python fold folds the run from 1
and parks the rest); every payload is JSON; every value an aggregation reads is of its kind (an amount a decimal, a
minimum's value a number: else the Python fold fails on it and quarantines the stream); and, where the state is
declared with types, the state fits them. Every other stream of the type is left to the Python fold
(`Native.left`), which gives it exactly what a Python reducer's stream gets.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from es_pipeline.declared import Agg
from es_pipeline.domain import Domain, Reducer
from es_pipeline.lake.state import state_json
from es_pipeline.lake.state.fold import FOLD_OUT


def native_types(domain: Domain) -> dict[str, Reducer]:
    """The stream types a first build folds natively: declared, and read as stored (no schema versions)."""
    if domain.schema_version != "none":
        return {}
    return {t: r for t, r in domain.folds.items() if r.declared is not None and r.history is None}


@dataclass(frozen=True)
class Native:
    """What the native build made: the fold's output rows of the streams it built, and the (tenant, stream_id)
    keys of the declared types' streams it left to the Python fold."""

    out: pa.Table
    left: pa.Table  # columns tenant, stream_id

    def keep_for_python(self, rows: pa.Table, types: Iterable[str]) -> pa.Table:
        """`rows` without the events of the streams built here."""
        declared = pa.array(sorted(types), pa.string())
        of_declared = pc.is_in(rows["stream_type"], value_set=declared)
        if self.left.num_rows == 0:
            return rows.filter(pc.invert(of_declared))
        keys = pc.binary_join_element_wise(pc.fill_null(rows["tenant"].cast(pa.string()), ""), rows["stream_id"],
                                           "\x00")
        left = pc.binary_join_element_wise(self.left["tenant"], self.left["stream_id"], "\x00")
        return rows.filter(pc.or_(pc.invert(of_declared), pc.is_in(keys, value_set=left)))


def build(dataset: Any, declared: dict[str, Reducer]) -> Native:
    """Every stream of the declared types in `dataset` (the `events` version the build reads, as an Arrow dataset)
    built natively where it can be (module docstring)."""
    import duckdb

    con = duckdb.connect()
    try:
        con.execute("SET threads TO 2")
        con.register("events_now", dataset)
        outs, lefts = [], []
        for stream_type, reducer in sorted(declared.items()):
            table = con.execute(_query(reducer), [stream_type]).fetch_arrow_table()
            ok = pc.fill_null(table["native"], False)
            if reducer.state is not None:
                fits, texts = _fitted(table["state"], reducer)
                ok = pc.and_(ok, fits)
                table = table.set_column(table.column_names.index("state"), "state", texts)
            built, left = table.filter(ok), table.filter(pc.invert(ok))
            outs.append(_fold_out(built, stream_type, reducer.revision))
            lefts.append(left.select(["tenant", "stream_id"]))
        return Native(pa.concat_tables(outs) if outs else FOLD_OUT.empty_table(),
                      pa.concat_tables(lefts) if lefts else pa.table({"tenant": pa.array([], pa.string()),
                                                                         "stream_id": pa.array([], pa.string())}))
    finally:
        con.close()


def _sql_text(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _in(types: tuple[str, ...] | None) -> str:
    return "TRUE" if types is None else f"event_type IN ({', '.join(_sql_text(t) for t in types)})"


def _value(agg: Agg) -> str:
    return f"json_extract(payload, {_sql_text('$.' + str(agg.source))})"


def _present(agg: Agg) -> str:
    return f"({_value(agg)} IS NOT NULL AND json_type({_value(agg)}) <> 'NULL')"


def _decimal(agg: Agg) -> str:
    return f"TRY_CAST(json_extract_string(payload, {_sql_text('$.' + str(agg.source))}) AS DECIMAL(38, {agg.scale}))"


def _field(name: str, agg: Agg) -> tuple[str, str]:
    """The aggregation of one field, and the condition under which a stream's events break it (a value of
    another kind: the Python fold fails there)."""
    where = _in(agg.types())
    if agg.kind == "count":
        return f"count(*) FILTER (WHERE {where})", "FALSE"
    if agg.kind == "last_of":
        cases = " ".join(f"WHEN {_sql_text(t)} THEN json({_sql_text(json.dumps(v))})" for t, v in agg.values)
        return f"arg_max(CASE event_type {cases} END, version) FILTER (WHERE {where})", "FALSE"
    if agg.kind in ("last", "first"):
        pick = "arg_max" if agg.kind == "last" else "arg_min"
        return f"{pick}({_value(agg)}, version) FILTER (WHERE {where} AND {_present(agg)})", "FALSE"
    if agg.kind in ("minimum", "maximum"):
        pick = "arg_min" if agg.kind == "minimum" else "arg_max"
        number = f"json_type({_value(agg)}) IN ('BIGINT', 'UBIGINT', 'DOUBLE')"
        return (f"{pick}({_value(agg)}, CAST(json_extract_string(payload, {_sql_text('$.' + str(agg.source))}) "
                f"AS DOUBLE)) FILTER (WHERE {where} AND {_present(agg)})",
                f"{where} AND {_present(agg)} AND NOT ({number})")
    assert agg.kind == "total"
    sign = (f"CASE WHEN event_type IN ({', '.join(_sql_text(t) for t in agg.subtract)}) THEN -1 ELSE 1 END"
            if agg.subtract else "1")
    total = f"coalesce(sum({sign} * {_decimal(agg)}) FILTER (WHERE {where} AND {_present(agg)}), 0)"
    # A number or a numeric string is an amount to both folds; a bool, an object or text is not.
    kind_ok = f"json_type({_value(agg)}) IN ('BIGINT', 'UBIGINT', 'DOUBLE', 'VARCHAR')"
    return (f"CAST(CAST({total} AS DECIMAL(38, {agg.scale})) AS VARCHAR)",
            f"{where} AND {_present(agg)} AND (NOT ({kind_ok}) OR {_decimal(agg)} IS NULL)")


def _query(reducer: Reducer) -> str:
    assert reducer.declared is not None
    fields = sorted(reducer.declared.fields)
    made = [(name, *_field(name, agg)) for name, agg in fields]
    state = ", ".join(f"{_sql_text(name)}, {aggregate}" for name, aggregate, _ in made)
    broken = " OR ".join(f"({bad})" for _, _, bad in made if bad != "FALSE") or "FALSE"
    return f"""
        SELECT coalesce(tenant, '') AS tenant, stream_id,
               CAST(max(version) AS INTEGER) AS version,
               arg_max(recorded_at, version) AS last_event_at,
               CAST(count(*) AS INTEGER) AS folded,
               CAST(json_merge_patch('{{}}', json_object({state})) AS VARCHAR) AS state,
               min(version) = 1 AND max(version) = count(*) AND count(DISTINCT version) = count(*)
                 AND bool_and(coalesce(payload_encoding, 'json') = 'json')
                 AND NOT bool_or({broken}) AS native
        FROM events_now
        WHERE stream_type = $1
        GROUP BY ALL
    """


def _fitted(states: pa.ChunkedArray, reducer: Reducer) -> tuple[pa.Array, pa.Array]:
    """Whether each state fits the reducer's declared fields, and its text as the Python fold writes it (the
    declared fields in their JSON form: `StreamFold` checks and writes the state so)."""
    codec = state_json.codec(reducer.state)
    fits, texts = [], []
    for text in states.to_pylist():
        try:
            texts.append(codec.dumps(codec.loads(text)))
            fits.append(True)
        except state_json.StateMisfit:
            texts.append(text)
            fits.append(False)
    return pa.array(fits, pa.bool_()), pa.array(texts, pa.string())


def _fold_out(table: pa.Table, stream_type: str, revision: int) -> pa.Table:
    n = table.num_rows

    def nulls(t: pa.DataType) -> pa.Array:
        return pa.nulls(n, t)

    columns = {
        "stream_id": table["stream_id"], "stream_type": pa.array([stream_type] * n, pa.string()),
        "version": table["version"], "state": table["state"],
        "last_event_at": table["last_event_at"].cast(FOLD_OUT.field("last_event_at").type),
        "revision": pa.array([revision] * n, pa.int32()), "parked": nulls(pa.string()),
        "skipped": pa.array([0] * n, pa.int32()), "folded": table["folded"], "error": nulls(pa.string()),
        "tenant": table["tenant"], "history_from": nulls(pa.int32()),
        "history_at": nulls(FOLD_OUT.field("history_at").type), "history": nulls(pa.string()),
        "quarantined": nulls(pa.string()),
    }
    return pa.table([columns[f.name] for f in FOLD_OUT], schema=FOLD_OUT)

