"""`stream_state`'s first build of declared reducers (es_pipeline/declared.py) as DuckDB aggregations, with no
Python call per event.

Within the engine rule's bound a first build folds every event here (lake/state/whole_fold.py). For a stream type
whose reducer is declared, that fold is one aggregation per stream type over the same version of `events` (its
Parquet files or Arrow dataset, read by DuckDB): per field the aggregation it declares, in version order
(`arg_max`/`arg_min` by version, a decimal `sum`, a `count`), each with its event types as a `FILTER`; the values kept
whole aggregated apart, over only the events that hold them, and joined by stream (`_query`); the state made as JSON
in the query, keys sorted, nulls left out, as the Python fold writes it. The rows are the fold's output (`FOLD_OUT`), as
`StreamFold.row` makes them.

Exactly the Python fold, or the Python fold itself: a stream is built natively only where the aggregation is the
fold's answer by construction. Its versions are 1..n with none missing (else the Python fold folds the run from 1
and parks the rest): the lake's key (tenant, stream_id, version) is unique (`events_no_duplicates`), so a stream
whose least version is 1 and greatest its count of events has them all; every payload is JSON; every value an aggregation reads is of its kind (an amount a decimal, a
minimum's value a number: else the Python fold fails on it and quarantines the stream); and, where the state is
declared with types, the state fits them. Every other stream of the type is left to the Python fold
(`Native.left`), which gives it exactly what a Python reducer's stream gets.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

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
    others: int = 0  # events of the types not declared: the Python fold's too

    @property
    def whole(self) -> bool:
        """Whether every event was built here: the Python fold has nothing to read."""
        return self.others == 0 and self.left.num_rows == 0

    def python_rows(self, types: Iterable[str]) -> ds.Expression:
        """A filter of `events`' rows that keeps those of the Python fold: every type but `types`, and the streams
        left to it (by id: `keep_for_python` then tells the tenants apart)."""
        others = ~ds.field("stream_type").isin(sorted(types))
        if self.left.num_rows == 0:
            return others
        return others | ds.field("stream_id").isin(pc.unique(self.left["stream_id"]))

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


def build(events: Any, declared: dict[str, Reducer]) -> Native:
    """Every stream of the declared types in `events` (the version the build reads: its local Parquet files, read by
    DuckDB's own reader, or an Arrow dataset) built natively where it can be (module docstring)."""
    import duckdb

    con = duckdb.connect()
    try:
        con.execute(f"SET threads TO {max(1, os.cpu_count() or 1)}")
        if isinstance(events, list):
            files = ", ".join(_sql_text(str(f)) for f in events) or "NULL"
            # by name: files of releases before `tenant` and `payload_encoding` lack them (NULL there)
            con.execute(f"CREATE VIEW events_now AS SELECT * FROM read_parquet([{files}], union_by_name = true)")
        else:
            con.register("events_now", events)
        outs, lefts = [], []
        for stream_type, reducer in sorted(declared.items()):
            try:
                table = con.execute(_query(reducer), [stream_type]).fetch_arrow_table()
            except duckdb.Error:  # a payload DuckDB's JSON reader refuses (Python's may not): the type is Python's
                lefts.append(con.execute("SELECT DISTINCT coalesce(tenant, '') AS tenant, stream_id FROM events_now "
                                         "WHERE stream_type = $1", [stream_type]).fetch_arrow_table())
                continue
            ok = pc.fill_null(table["native"], False)
            if reducer.state is not None:
                fits, texts = _fitted(table["state"], reducer)
                ok = pc.and_(ok, fits)
                table = table.set_column(table.column_names.index("state"), "state", texts)
            built, left = table.filter(ok), table.filter(pc.invert(ok))
            outs.append(_fold_out(built, stream_type, reducer.revision))
            lefts.append(left.select(["tenant", "stream_id"]))
        types = ", ".join(_sql_text(t) for t in sorted(declared))
        (others,) = con.execute(f"SELECT count(*) FROM events_now WHERE stream_type IS NULL OR stream_type NOT IN "
                                f"({types})").fetchone()  # type: ignore[misc]
        return Native(pa.concat_tables(outs) if outs else FOLD_OUT.empty_table(),
                      pa.concat_tables([t.cast(_KEYS) for t in lefts]) if lefts else pa.table({"tenant": pa.array([], pa.string()),
                                                                         "stream_id": pa.array([], pa.string())}),
                      int(others))
    finally:
        con.close()


_KEYS = pa.schema([("tenant", pa.string()), ("stream_id", pa.string())])


def _sql_text(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _in(types: tuple[str, ...] | None) -> str:
    return "TRUE" if types is None else f"event_type IN ({', '.join(_sql_text(t) for t in types)})"


@dataclass(frozen=True)
class _Names:
    """The query's column names, by position: a payload field's (`sources`) and a state field's (`fields`). DuckDB's
    names ignore case, payload and state fields do not."""

    sources: dict[str, int]
    fields: dict[str, int]

    @classmethod
    def of(cls, fields: list[tuple[str, Agg]]) -> _Names:
        sources = sorted({str(a.source) for _, a in fields if a.source})
        return cls({s: i for i, s in enumerate(sources)}, {name: i for i, (name, _) in enumerate(fields)})

    def value(self, source: str | None) -> str:
        """A payload field's JSON value, extracted once per event."""
        return f'"v_{self.sources[str(source)]}"'

    def text(self, source: str | None) -> str:
        """A payload field's value as text (a total's amount), extracted once per event."""
        return f'"s_{self.sources[str(source)]}"'

    def kind(self, source: str | None) -> str:
        """The JSON type of a payload field's value, once per event."""
        return f'"t_{self.sources[str(source)]}"'

    def decimal(self, agg: Agg) -> str:
        """An event's amount as a decimal of 18 digits (64 bits: a cast 20 times faster than to 38), summed into 38;
        an amount past 18 digits is no value here, and its stream goes to the Python fold."""
        return f'"d_{self.sources[str(agg.source)]}_{agg.scale}"'

    def field(self, name: str) -> str:
        """A state field's aggregate, once per stream."""
        return f'"f_{self.fields[name]}"'

    def present(self, agg: Agg) -> str:
        if agg.kind == "total":
            return f"{self.text(agg.source)} IS NOT NULL"  # a JSON null's text is NULL too
        value = self.value(agg.source)
        return f"({value} IS NOT NULL AND CAST({value} AS VARCHAR) <> 'null')"


def _field(name: str, agg: Agg, names: _Names) -> tuple[str, str, str]:
    """One field: its aggregation over a stream's events (plain values), its JSON value made from that once per
    stream, and the condition under which an event breaks it (a value of another kind: the Python fold fails
    there)."""
    where = _in(agg.types())
    alias = names.field(name)
    if agg.kind == "count":
        return f"count(*) FILTER (WHERE {where})", alias, "FALSE"
    if agg.kind == "last_of":  # the last such event's position among the values, its JSON constant made after
        cases = " ".join(f"WHEN {_sql_text(t)} THEN {i}" for i, (t, _) in enumerate(agg.values))
        values = " ".join(f"WHEN {i} THEN json({_sql_text(json.dumps(v))})" for i, (_, v) in enumerate(agg.values))
        return (f"arg_max(CASE event_type {cases} END, version) FILTER (WHERE {where})",
                f"CASE {alias} {values} END", "FALSE")
    # An integer past 64 bits is a Python int but a double to DuckDB's JSON reader: such a stream is Python's.
    huge = (f"({names.kind(agg.source)} = 'DOUBLE' AND abs(TRY_CAST(json_extract_string({names.value(agg.source)}, '$') AS DOUBLE)) "
            f">= 9.2e18)")
    if agg.kind in ("last", "first"):
        pick = "arg_max" if agg.kind == "last" else "arg_min"
        return (f"{pick}({names.value(agg.source)}, version) FILTER (WHERE {where} AND {names.present(agg)})", alias,
                f"{where} AND {names.present(agg)} AND {huge}")
    if agg.kind in ("minimum", "maximum"):
        # By value, then the earliest version among equal values (Python keeps the first it met: strict < and >);
        # a value that is no finite number, or an integer a double does not hold exactly, is Python's.
        number = f"TRY_CAST(json_extract_string({names.value(agg.source)}, '$') AS DOUBLE)"
        key = f"[{number}, {'' if agg.kind == 'minimum' else '-'}version]"
        pick = "arg_min" if agg.kind == "minimum" else "arg_max"
        kind_ok = (f"{names.kind(agg.source)} IN ('BIGINT', 'UBIGINT', 'DOUBLE') AND isfinite({number}) "
                   f"AND abs({number}) < 9007199254740992")
        return (f"{pick}({names.value(agg.source)}, {key}) FILTER (WHERE {where} AND {names.present(agg)} AND {kind_ok})", alias,
                f"{where} AND {names.present(agg)} AND NOT ({kind_ok})")
    assert agg.kind == "total"
    sign = (f"CASE WHEN event_type IN ({', '.join(_sql_text(t) for t in agg.subtract)}) THEN -1 ELSE 1 END"
            if agg.subtract else "1")
    # A number or a numeric string is an amount to both folds; a bool, an object or other text is not (no decimal).
    return (f"coalesce(sum({sign} * {names.decimal(agg)}) FILTER (WHERE {where} AND {names.present(agg)}), 0)",
            f"'\"' || CAST(CAST({alias} AS DECIMAL(38, {agg.scale})) AS VARCHAR) || '\"'",  # its digits, a string
            f"{where} AND {names.present(agg)} AND {names.decimal(agg)} IS NULL")


_SOURCED = ("last", "first", "minimum", "maximum", "total")  # the aggregations that read a payload field
_VALUED = ("last", "first", "minimum", "maximum")  # those that keep a payload value whole (a JSON value, a VARIANT)


def _reads(fields: list[tuple[str, Agg]], kinds: tuple[str, ...]) -> dict[str, tuple[str, ...] | None]:
    """Per payload field read by aggregations of `kinds`, the event types they read it from (None: all)."""
    found: dict[str, set[str] | None] = {}
    for _, agg in fields:
        if agg.source is None or agg.kind not in kinds:
            continue
        types = agg.types()
        held = found.get(agg.source, set())
        found[agg.source] = None if types is None or held is None else held | set(types)
    return {k: None if v is None else tuple(sorted(v)) for k, v in sorted(found.items())}


def _types_of(fields: list[tuple[str, Agg]], kinds: tuple[str, ...]) -> tuple[str, ...] | None:
    """The event types that aggregations of `kinds` read (None: every type)."""
    read = [agg.types() for _, agg in fields if agg.kind in kinds]
    return None if None in read else tuple(sorted({t for types in read for t in types or ()}))


def _twice(source: str) -> str:
    """Whether a payload holds key `source` twice. JSON allows it; DuckDB's reader then takes the first value, Python's
    the last. The key's text twice (or, with an escape, which may spell the key otherwise, its keys counted); a payload
    too short to hold it twice ({"k":v,"k":v}) is not looked into."""
    return (f"CASE WHEN strlen(payload) < {2 * (len(json.dumps(source)) + 2) + 3} THEN FALSE "
            f"WHEN contains(payload, '\\') THEN len(list_filter(json_keys(payload), k -> k = {_sql_text(source)})) > 1 "
            f"ELSE payload LIKE {_sql_text(f'%{json.dumps(source)}%{json.dumps(source)}%')} END")


# What DuckDB's JSON reader takes and Python's refuses: a comma before a closing bracket, `nan` and `inf` (any case;
# Python takes only NaN and Infinity). A payload that may hold one (also such text in a string, after a colon, a comma
# or a bracket) is Python's.
_LENIENT = r",\s*[\]}]|[:\[,]\s*-?(?i:nan|inf)"


def _read_alike(read: dict[str, tuple[str, ...] | None]) -> str:
    """Per event, whether DuckDB reads its payload as the Python fold does: no field it reads held twice (`_twice`),
    and, for the event types no field reads, a payload that is JSON (the Python fold parses every payload and fails on
    one that is not; those a field reads DuckDB parses, and refuses: the whole type is then Python's). One `CASE` on
    the event type, so that each event is looked at for its own type's fields alone."""
    if not read:
        return "json_valid(payload)"
    if None in read.values():  # a field read from every type: every payload parsed, each looked at for every field
        return "NOT (" + " OR ".join(
            f"({_in(types)} AND {_twice(source)})" if types else _twice(source) for source, types in read.items()) + ")"
    by_type: dict[str, list[str]] = {}
    for source, types in read.items():
        for event_type in types or ():
            by_type.setdefault(event_type, []).append(source)
    grouped: dict[tuple[str, ...], list[str]] = {}  # the event types that read the same fields, together
    for event_type, sources in sorted(by_type.items()):
        grouped.setdefault(tuple(sources), []).append(event_type)
    cases = " ".join(f"WHEN {_in(tuple(types))} THEN NOT ({' OR '.join(f'({_twice(s)})' for s in sources)})"
                     for sources, types in grouped.items())
    return f"CASE {cases} ELSE json_valid(payload) END"


def _query(reducer: Reducer) -> str:
    """One aggregation per stream of the type, in two, joined by stream (the numbers' rows are every stream's):
    - `numbers`, over every event: the version checks, counts, totals and constants (fixed-width states: DuckDB's
      hash aggregation, no JSON value per event but a total's amount);
    - `valued`, over only the events of the types that a value kept whole (`last`, `first`, a minimum or maximum)
      reads: those values, as JSON, with their checks. Most events are of other types (deposits, not openings), so
      most events' payloads are read once, for an amount, or only checked.
    Each payload field is extracted once per event (as JSON, or as text for a total), and only from the event types
    that read it."""
    assert reducer.declared is not None
    fields = sorted(reducer.declared.fields)
    names = _Names.of(fields)
    texts = "".join(
        f", CASE WHEN {_in(types)} THEN json_extract_string(payload, {_sql_text('$.' + source)}) END "
        f"AS {names.text(source)}" for source, types in _reads(fields, ("total",)).items())
    read = _reads(fields, _SOURCED)
    # DuckDB's cast rounds a text with an exponent otherwise than Python's Decimal ('5e-7' to 0.01 at two places): such
    # an amount is none here, and its stream Python's.
    amounts = "".join(
        f", CASE WHEN NOT (contains({names.text(source)}, 'e') OR contains({names.text(source)}, 'E')) "
        f"THEN TRY_CAST({names.text(source)} AS DECIMAL(18, {scale})) END AS {names.decimal(Agg('total', source, scale=scale))}"
        for source, scale in sorted({(str(agg.source), agg.scale) for _, agg in fields if agg.kind == "total"}))
    made = [(name, agg, *_field(name, agg, names)) for name, agg in fields]

    def aggregates(valued: bool) -> str:
        return "".join(f", {aggregate} AS {names.field(name)}" for name, agg, aggregate, _, _ in made
                       if (agg.kind in _VALUED) == valued)

    def broken(valued: bool) -> str:
        return " OR ".join(f"({bad})" for _, agg, _, _, bad in made
                           if bad != "FALSE" and (agg.kind in _VALUED) == valued) or "FALSE"

    # The state's text: a key per field that has a value (as the fold leaves an unset field out), keys sorted.
    state = ", ".join(f"CASE WHEN {names.field(name)} IS NOT NULL THEN {_sql_text(json.dumps(name) + ':')} || "
                      f"CAST({value} AS VARCHAR) END" for name, _, _, value, _ in made)
    key = "coalesce(tenant, '') AS tenant, stream_id, version, event_type"
    # A value kept whole holding an integer of 19 digits or more (within it, at any depth): DuckDB keeps its digits,
    # the Python fold's reader (orjson) makes a double of one past 64 bits. Such a stream is Python's.
    long_digits = "".join(f" AND ({names.field(name)} IS NULL OR NOT regexp_matches(CAST({names.field(name)} AS VARCHAR), "
                          f"'[0-9]{{19}}'))" for name, agg in fields if agg.kind in ("last", "first"))
    valued = ""
    if any(agg.kind in _VALUED for _, agg in fields):
        kept = _reads(fields, _VALUED)
        values = "".join(
            f", CASE WHEN {_in(types)} THEN json_extract(payload, {_sql_text('$.' + source)}) END "
            f"AS {names.value(source)}" for source, types in kept.items())
        kinds = "".join(f", json_type({names.value(source)}) AS {names.kind(source)}" for source in kept)
        types = _types_of(fields, _VALUED)
        valued = f""", valued AS (
            SELECT tenant, stream_id, NOT bool_or(coalesce({broken(True)}, TRUE)) AS valued_ok{aggregates(True)}
            FROM (SELECT *{kinds} FROM (
                SELECT {key}{values} FROM events_now
                WHERE stream_type = $1 AND {_in(types)}))
            GROUP BY tenant, stream_id
        )"""
    return f"""
        WITH numbers AS (
            SELECT tenant, stream_id,
                   CAST(max(version) AS INTEGER) AS version,
                   arg_max_null(recorded_at, version) AS last_event_at,
                   CAST(count(*) AS INTEGER) AS folded,
                   min(version) = 1 AND max(version) = count(*)
                     AND sum(CAST(version AS BIGINT)) = count(*) * (count(*) + 1) // 2
                     AND bool_and(coalesce(payload_encoding, 'json') = 'json' AND coalesce(read_alike, FALSE))
                     AND NOT bool_or(coalesce({broken(False)}, TRUE))
                     AS native{aggregates(False)}
            FROM (SELECT *{amounts} FROM (
                SELECT {key}, recorded_at, payload_encoding{texts},
                       ({_read_alike(read)}) AND NOT regexp_matches(payload, {_sql_text(_LENIENT)}) AS read_alike
                FROM events_now
                WHERE stream_type = $1))
            GROUP BY tenant, stream_id
        ){valued}
        SELECT tenant, stream_id, version, last_event_at, folded,
               native{" AND coalesce(valued_ok, TRUE)" if valued else ""}{long_digits} AS native,
               '{{' || concat_ws(',', {state}) || '}}' AS state
        FROM numbers{" LEFT JOIN valued USING (tenant, stream_id)" if valued else ""}
    """


def _fitted(states: pa.ChunkedArray, reducer: Reducer) -> tuple[pa.Array, pa.Array]:
    """Whether each state fits the reducer's declared fields, and its text as the Python fold writes it (the
    declared fields in their JSON form: `StreamFold` checks and writes the state so)."""
    codec = state_json.codec(reducer.state)
    decimals = reducer.declared.decimals if reducer.declared is not None else ()
    fits, texts = [], []
    for text in states.to_pylist():
        try:
            state = json.loads(text)
            for name in decimals:  # the fold holds a total declared a decimal as a Decimal; every other value as read
                if state.get(name) is not None:
                    state[name] = Decimal(state[name])
            texts.append(codec.dumps(state))
            fits.append(True)
        except Exception:  # noqa: BLE001 - a state the fold could not write either: the Python fold says why
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

