"""`stream_state`'s first build of declared reducers (es_pipeline/declared.py) on Spark, as Spark's own aggregations:
no Python call per event.

Past the engine rule's bound a first build runs on Spark (lake/state/stream_state.py). For a stream type whose reducer
is declared, it is one `GROUP BY` stream over the type's events of the `events` version the build reads: each payload
parsed once (`try_parse_json`, a VARIANT) and the fields read from it; per state field the aggregation it declares in
version order (`max_by`/`min_by` by version, an exact decimal `sum`, a `count`), each with its event types as a
`FILTER`; the state made as JSON in the query. The rows are the fold's output (`FOLD_OUT`), as `StreamFold.row` makes
them, so they join the Python fold's rows of every other stream and are written with them.

The same rule as the build in process (lake/state/declared_build.py): a stream is taken from the aggregation only where
the aggregation is the Python fold's answer by construction, and every other stream of the type goes to the Python
fold on Spark's workers (`Native.left`). Taken: versions 1..n with none missing; every payload JSON that Spark's parser
reads as Python's does (one value and nothing after it, which Spark's parser would ignore; no duplicate key, which
Spark refuses and Python reads as the last; no NaN; no lone surrogate, which Spark's parser would make a `?`); every amount plain digits a double holds exactly (at most 15 of them where it
has a fraction: Python reads a JSON number as a double); every minimum's value a finite number; a value kept whole
(`last`, `first`) with no double in it (an integer past 38 digits is one to Spark, exact to Python); and, where the state
is declared with types, a state that fits them (checked once per stream by the codec that writes it, on the workers).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from es_pipeline.declared import Agg
from es_pipeline.domain import Reducer
from es_pipeline.lake.delta.definition import spark_type
from es_pipeline.lake.state.declared_build import (
    _SOURCED,
    _VALUED,
    _fitted,
    _in,
    _reads,
    _sql_text,
    _types_of,
)
from es_pipeline.lake.state.fold import FOLD_OUT
from es_pipeline.lake.state.state_table import KEY


# An amount both folds read alike, told without a regular expression (one per event cost 0.7 s at 5M events):
# - it begins with a digit or a minus and ends with a digit: Spark's cast trims control characters that Python's
#   `Decimal` refuses (and Python strips Unicode spaces that Spark's cast refuses: those are Python's either way);
# - it has at most 16 characters where it has a point (so at most 15 digits: a double holds those exactly, and Python
#   reads a JSON number as a double; an integer Python reads exactly, as Spark's decimal does).
# Within these, the text is one both parse alike (Java's BigDecimal and Python's Decimal: digits, a point, an
# exponent), or one Spark's `try_cast` refuses (then the stream is Python's).
def _plain_amount(text: str) -> str:
    return (f"(ascii({text}) BETWEEN 48 AND 57 OR ascii({text}) = 45) AND ascii(substr({text}, -1)) BETWEEN 48 AND 57 "
            f"AND (length({text}) <= 16 OR NOT contains({text}, '.'))")
# Spark's parser reads a text's first JSON value and ignores what follows (`{"a":1} x`), Python's refuses the text. So
# a payload is parsed as the array `[payload,"\u0001"]`, and is one value and nothing after it when the array's second
# element is that mark and there is no third. Without a `]` of its own the payload cannot close the array early, so
# the array is its values and the mark; with one, it must not spell the mark, which JSON spells only with a `\u`
# escape (`1,"\u0001"]x` would read as one value and the mark). The mark is short: the parse reads it per event.
_END = ',"\\\\u0001"]'  # the SQL literal of the text ,"\u0001"]
# Looking into the array costs (two `variant_get`s per event: 0.3 of the build at 5M): an object whose only `}` is its
# last character ends there, so it is one value without looking (a flat object, as most payloads are).
_ONE_VALUE = ("(startswith(payload, '{') AND instr(payload, '}') = length(payload) "
              "OR variant_get(_v, '$[1]', 'string') = chr(1) AND variant_get(_v, '$[2]') IS NULL "
              "AND NOT (contains(payload, ']') AND contains(payload, '\\\\u')))")
_AGGREGATED = ("tenant STRING, stream_id STRING, version INT, last_event_at TIMESTAMP, folded INT, native BOOLEAN, "
               "state STRING")


@dataclass(frozen=True)
class Counted:
    """The native build's figures, from the one action that computes (and caches) its aggregation: the streams built
    here and their events, the streams left to the Python fold, and every event of the declared types."""

    streams: int
    folded: int
    left: int
    events: int


@dataclass
class Native:
    """The native build on Spark: `out`, the fold's output rows (`FOLD_OUT`) of the streams built here; `left`, the
    (tenant, stream_id) of the declared types' streams left to the Python fold; `cached`, what to unpersist."""

    out: Any
    left: Any
    cached: Any
    _counted: Counted | None = field(default=None, init=False, repr=False, compare=False)

    def counted(self) -> Counted:
        """The figures (`Counted`), computed once: the action that runs the aggregation into its cache."""
        if self._counted is None:
            from pyspark.sql import functions as F

            native = F.coalesce(F.col("native"), F.lit(False))
            row = self.cached.agg(
                F.count_if(native).alias("streams"), F.sum(F.when(native, F.col("folded"))).alias("folded"),
                F.count_if(~native).alias("left"), F.sum("folded").alias("events")).first()
            self._counted = Counted(int(row["streams"]), int(row["folded"] or 0), int(row["left"]),
                                    int(row["events"] or 0))
        return self._counted

    def python_events(self, events: Any, types: list[str],
                      rows: Callable[[], int | None] = lambda: None) -> Any | None:
        """`events` (as `spark_columns` reads them) without those of the streams built here; None where that leaves
        none (no stream left, no other type: the Python fold has nothing to do). `rows`: the count of `events`'
        rows where its log says it exactly (lake/delta/current.py's `exact_row_count`), asked only where no stream is
        left: then whether there are other types is told without a scan (every row is of a declared type where the
        aggregation counted them all)."""
        from pyspark.sql import functions as F

        declared = F.col("stream_type").isin(types)
        others = events.where(~declared | F.col("stream_type").isNull())
        counted = self.counted()
        if counted.left == 0:
            if rows() == counted.events:
                return None
            return None if others.isEmpty() else others
        return others.unionByName(events.where(declared).join(self.left, list(KEY), "left_semi"))

    def figures(self) -> dict[str, Any]:
        """The build's figures where every event was built here, as `update_stream_state` reads them from a fold's
        rows: nothing parked, skipped, failed, quarantined or without a reducer."""
        counted = self.counted()
        return {"streams": counted.streams, "parked": 0, "skipped": 0, "folded": counted.folded, "error": None,
                "without_reducer": 0, "quarantined": 0}

    def unpersist(self) -> None:
        self.cached.unpersist()


def build(events: Any, declared: dict[str, Reducer]) -> Native:
    """Every stream of the declared types in `events` (a DataFrame of the `events` version the build reads, its own
    columns) built natively where it can be (module docstring)."""
    from functools import reduce

    from pyspark.sql import functions as F

    parts = []
    for stream_type, reducer in sorted(declared.items()):
        part = _sql(events, _query(reducer, stream_type))
        if reducer.state is not None:  # the codec checks and writes a typed state: once per stream, on the workers
            part = part.mapInArrow(_fit(reducer), _AGGREGATED)
        parts.append(part.withColumn("stream_type", F.lit(stream_type))
                     .withColumn("revision", F.lit(reducer.revision).cast("int")))
    aggregated = reduce(lambda a, b: a.unionByName(b), parts).cache()
    native = F.coalesce(F.col("native"), F.lit(False))
    # The fold's output columns the aggregation has not: none skipped, the rest null (no park, error or history).
    out = aggregated.where(native).select(*[
        F.col(f.name) if f.name in aggregated.columns
        else F.lit(0).cast("int").alias(f.name) if f.name == "skipped"
        else F.lit(None).cast(spark_type(f.type)).alias(f.name) for f in FOLD_OUT])
    return Native(out, aggregated.where(~native).select(*KEY), aggregated)


def _sql(events: Any, query: str) -> Any:
    """`query` over `events` (named `{events}` in it), as a DataFrame argument, not a view of the session's: two
    builds at once in one session (or over Spark Connect) each read their own."""
    escaped = query.replace("{", "{{").replace("}", "}}").replace("{{events}}", "{events}")
    return events.sparkSession.sql(escaped, events=events)


def _fit(reducer: Reducer) -> Any:
    def fit(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            fits, texts = _fitted(pa.chunked_array([batch.column("state")]), reducer)
            names = batch.schema.names
            columns = list(batch.columns)
            columns[names.index("state")] = texts
            columns[names.index("native")] = pc.and_(pc.fill_null(batch.column("native"), False), fits)
            yield pa.RecordBatch.from_arrays(columns, schema=batch.schema)
    return fit


def _field(agg: Agg, i: int, sources: dict[str, int]) -> tuple[str, str, str]:
    """One field: its aggregation over a stream's events, its JSON text made from that once per stream, and the
    condition under which an event leaves the stream to the Python fold."""
    where = _in(agg.types())
    alias = f"f_{i}"
    if agg.kind == "count":
        return f"count(*) FILTER (WHERE {where})", f"CAST({alias} AS STRING)", "FALSE"
    if agg.kind == "last_of":
        cases = " ".join(f"WHEN {_sql_text(t)} THEN {k}" for k, (t, _) in enumerate(agg.values))
        values = " ".join(f"WHEN {k} THEN {_sql_text(json.dumps(v))}" for k, (_, v) in enumerate(agg.values))
        return (f"max_by(CASE event_type {cases} END, version) FILTER (WHERE {where})", f"CASE {alias} {values} END",
                "FALSE")
    value = f"v_{sources[str(agg.source)]}"
    present = f"({value} IS NOT NULL AND NOT is_variant_null({value}))"
    if agg.kind in ("last", "first"):
        pick = "max_by" if agg.kind == "last" else "min_by"
        # a lone surrogate escape, which Spark's parser turns into '?' and Python keeps: Python's
        surrogate = r"(contains(payload, '\\u') AND payload RLIKE '\\\\u[dD][89abAB]')"
        return (f"{pick}({value}, version) FILTER (WHERE {where} AND {present})", f"to_json({alias})",
                f"{where} AND {present} AND {surrogate}")
    if agg.kind in ("minimum", "maximum"):
        number = f"try_variant_get({value}, '$', 'double')"
        kind_ok = (f"(schema_of_variant({value}) IN ('BIGINT', 'DOUBLE') OR schema_of_variant({value}) LIKE 'DECIMAL%') "
                   f"AND NOT isnan({number}) AND abs({number}) < 9007199254740992")
        pick = "min_by" if agg.kind == "minimum" else "max_by"
        key = f"named_struct('n', {number}, 'v', {'' if agg.kind == 'minimum' else '-'}version)"
        return (f"{pick}({value}, {key}) FILTER (WHERE {where} AND {present} AND {kind_ok})", f"to_json({alias})",
                f"{where} AND {present} AND NOT ({kind_ok})")
    assert agg.kind == "total"
    # The amount, once per event (`_parsed`): a decimal where its text is plain (`_plain_amount`), else null.
    text, amount = f"a_{sources[str(agg.source)]}", f"d_{sources[str(agg.source)]}_{agg.scale}"
    signed = (f"CASE WHEN event_type IN ({', '.join(_sql_text(t) for t in agg.subtract)}) THEN -{amount} ELSE {amount} END"
              if agg.subtract else amount)
    return (f"coalesce(sum({signed}) FILTER (WHERE {where}), 0)",
            f"concat('\"', CAST(CAST({alias} AS DECIMAL(38, {agg.scale})) AS STRING), '\"')",
            f"{where} AND {text} IS NOT NULL AND {amount} IS NULL")


def parsed(events: Any, reducer: Reducer, stream_type: str) -> Any:
    """The type's events of `events` with their payload fields as the build reads them (`v_<i>`, VARIANTs; `a_<i>`, a
    total's amount as text; `d_<i>_<scale>`, the amount where it is plain): what the build aggregates, and what
    bench/declared_fold.py's plain `groupBy` reads."""
    return _sql(events, _parsed(reducer, stream_type))


def _parsed(reducer: Reducer, stream_type: str) -> str:
    """Over `{events}`: each payload parsed once, each field the declaration reads taken once per event, from
    the event types that read it."""
    assert reducer.declared is not None
    fields = sorted(reducer.declared.fields)
    read = _reads(fields, _SOURCED)
    sources = {source: i for i, source in enumerate(read)}
    values = "".join(f", CASE WHEN {_in(types)} THEN variant_get(_v, {_sql_text('$[0].' + source)}) END AS v_{sources[source]}"
                     for source, types in read.items())
    # Whether the payload is JSON as Python reads it, next to its parse (the VARIANT goes no further than the fields).
    values += f", coalesce(coalesce(payload_encoding, 'json') = 'json' AND _v IS NOT NULL AND {_ONE_VALUE}, FALSE) AS _json"
    amounts = "".join(f", variant_get(v_{sources[source]}, '$', 'string') AS a_{sources[source]}"
                      for source in _reads(fields, ("total",)))
    decimals = "".join(
        f", CASE WHEN {_plain_amount(f'a_{sources[source]}')} THEN try_cast(a_{sources[source]} AS DECIMAL(18, {scale})) END "
        f"AS d_{sources[source]}_{scale}"
        for source, scale in sorted({(str(agg.source), agg.scale) for _, agg in fields if agg.kind == "total"}))
    return f"""
        SELECT *{decimals} FROM (SELECT *{amounts} FROM (
            SELECT *{values} FROM (
                SELECT coalesce(tenant, '') AS tenant, stream_id, version, event_type, recorded_at, payload,
                       payload_encoding, CASE WHEN coalesce(payload_encoding, 'json') = 'json'
                                              THEN try_parse_json(concat('[', payload, '{_END}')) END AS _v
                FROM {{events}}
                WHERE stream_type = {_sql_text(stream_type)})))
    """


def _query(reducer: Reducer, stream_type: str) -> str:
    """One aggregation per stream of the type over `_parsed`'s rows (of `{events}`), in two: the counts, totals,
    constants and checks over every event (fixed-width buffers: Spark's hash aggregation), and the values kept whole
    (`max_by` of a VARIANT: a sort aggregation) over only the events of the types they read, joined by stream."""
    assert reducer.declared is not None
    fields = sorted(reducer.declared.fields)
    sources = {source: i for i, source in enumerate(_reads(fields, _SOURCED))}
    made = [(name, agg, *_field(agg, i, sources)) for i, (name, agg) in enumerate(fields)]
    numbers = "".join(f", {aggregate} AS f_{i}" for i, (_, agg, aggregate, _, _) in enumerate(made)
                      if agg.kind not in _VALUED)
    values = "".join(f", {aggregate} AS f_{i}" for i, (_, agg, aggregate, _, _) in enumerate(made)
                     if agg.kind in _VALUED)
    state = ", ".join(f"CASE WHEN f_{i} IS NOT NULL THEN concat({_sql_text(json.dumps(name) + ':')}, {value}) END"
                      for i, (name, _, _, value, _) in enumerate(made))
    broken = " OR ".join(f"({bad})" for _, _, _, _, bad in made if bad != "FALSE") or "FALSE"
    valued = "" if not values else f""", valued AS (
            SELECT tenant, stream_id{values}
            FROM typed
            WHERE {_in(_types_of(fields, _VALUED))}
            GROUP BY tenant, stream_id
        )"""
    return f"""
        WITH typed AS ({_parsed(reducer, stream_type)}
        ), numbers AS (
            SELECT tenant, stream_id,
                   CAST(max(version) AS INT) AS version,
                   max_by(recorded_at, version) AS last_event_at,
                   CAST(count(*) AS INT) AS folded,
                   min(version) = 1 AND max(version) = count(*)
                     AND sum(CAST(version AS BIGINT)) = count(*) * (count(*) + 1) DIV 2
                     AND bool_and(_json)
                     AND NOT bool_or(coalesce({broken}, TRUE)) AS native{numbers}
            FROM typed
            GROUP BY tenant, stream_id
        ){valued}
        SELECT tenant, stream_id, version, last_event_at, folded,
               native AND {' AND '.join(_kept_whole(i, agg) for i, (_, agg) in enumerate(fields))} AS native,
               concat('{{', concat_ws(',', {state}), '}}') AS state
        FROM numbers{" LEFT JOIN valued USING (tenant, stream_id)" if values else ""}
    """


def _kept_whole(i: int, agg: Agg) -> str:
    """A value kept whole (`last`, `first`) with no double in it (Spark reads an integer past 38 digits as one) and no
    integer of 19 digits or more (Spark keeps its digits up to 38, the Python fold's reader, orjson, makes a double of
    one past 64 bits). (A minimum's or maximum's value is a number a double holds exactly, checked per event.)"""
    if agg.kind in ("last", "first"):
        return (f"(f_{i} IS NULL OR NOT contains(schema_of_variant(f_{i}), 'DOUBLE') "
                f"AND NOT to_json(f_{i}) RLIKE '[0-9]{{19}}')")
    return "TRUE"
