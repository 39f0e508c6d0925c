"""One rule for typed values, whatever the path and whatever the batches (pure: no store, no Spark).

A batch of one type's payloads becomes typed rows by Arrow's JSON reader where it can, value by value in Python
otherwise (lake/typed/typed_rows.py); a table takes batches one after another, placing its earlier rows again where a
column comes or widens. Over random payloads and random declared schemas these tests assert that both paths give
the same columns and values for any batch, and that a table built batch by batch equals one built at once.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import os
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from es_pipeline.domain import Domain, DomainError
from es_pipeline.lake.typed import shapes, typed_rows
from es_pipeline.lake.typed.typed_rows import Typed, regrown, to_place_again, type_rows

_AT = dt.datetime(2026, 11, 27, tzinfo=dt.UTC)
_TEXTS = st.sampled_from(["x", "2024-05-01", "2024-05-01T10:00:00", "2024-05-01T10:00:00+02:00",
                          "2024-05-01T10:00:00Z", "10:30:00", "10:30:00.5", "1.25", "12.345", "aGk=", "not base64!"])
_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**65), max_value=2**65)
            | st.sampled_from([0, 1, 45000, 2**53 + 1, -(2**63), 2**63 - 1])
            | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([1.5, 0.1, 1e20, -0.0])
            | _TEXTS | st.text(max_size=3))
_KEYS = st.sampled_from(["a", "b", "c", "x", "version", "A", "odd-key"])
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=3),
                     max_leaves=6)
_PAYLOAD = st.dictionaries(_KEYS, _JSON, max_size=4)
_REGULAR = st.fixed_dictionaries({}, optional={  # one kind per field: the batches Arrow's reader takes
    "a": st.none() | st.integers(min_value=-(2**60), max_value=2**60) | st.sampled_from([1.5, 2.0]) | _TEXTS,
    "b": st.none() | st.text(max_size=4) | _TEXTS,
    "c": st.lists(st.none() | st.floats(allow_nan=False, allow_infinity=False), max_size=3),
    "x": st.dictionaries(st.sampled_from(["p", "q"]), st.none() | st.booleans(), max_size=2),
    "version": st.integers(min_value=0, max_value=9),
})
_DECLARABLE = st.sampled_from([
    pa.date32(), pa.timestamp("us", tz="UTC"), pa.timestamp("us"), pa.decimal128(10, 2), pa.float32(),
    pa.map_(pa.string(), pa.int64()), pa.int64(), pa.int32(), pa.float64(), pa.string(),
    pa.bool_(), pa.binary(), pa.struct([("x", pa.int64())]), pa.list_(pa.string()),
    pa.struct([("x", pa.timestamp("us", tz="UTC"))]), pa.list_(pa.date32()),
])
_DECLARED = st.one_of(st.none(), st.dictionaries(st.sampled_from(["a", "b", "c", "version"]), _DECLARABLE,
                                                 min_size=1, max_size=3).map(lambda d: pa.schema(list(d.items()))))


def _rows(payloads: list[Any]) -> pa.Table:
    texts = [p if isinstance(p, str) else json.dumps(p) for p in payloads]
    return pa.table({"payload": pa.array(texts, pa.string()),
                     "recorded_at": pa.array([_AT] * len(texts), pa.timestamp("us", tz="UTC"))})


def _columns(found: dict[str, Any], held: dict[str, pa.DataType]) -> dict[str, tuple[pa.DataType, list[Any]]]:
    return {c: (v.type, v.to_pylist()) for c, v in found.items()} | {
        c: (t, None) for c, t in held.items() if c not in found}


def _same(a: list[Any] | None, b: list[Any] | None) -> bool:
    return a == b or ((a is None or all(v is None for v in a)) and (b is None or all(v is None for v in b)))


@settings(max_examples=int(os.environ.get("ES_PIPELINE_EXAMPLES", "500")), deadline=None)
@given(st.lists(_PAYLOAD, min_size=1, max_size=5) | st.lists(_REGULAR, min_size=1, max_size=8),
       st.lists(_PAYLOAD | _REGULAR, max_size=3), _DECLARED)
@example(payloads=[{"a": None, "x": {"p": None, "q": False}}, {"x": {"p": False}}], before=[], declared=None)
def test_arrow_and_python_give_the_same_columns_for_any_batch(payloads: list[dict], before: list[dict],
                                                             declared: pa.Schema | None) -> None:
    held = type_rows(_rows(before), None, declared=declared).rows.schema if before else None
    columns, fixed = typed_rows.payload_columns(held, declared)
    fast = typed_rows.arrow_path(_rows(payloads), dict(columns), fixed)
    event("arrow" if fast is not None else "value by value")
    if fast is None:
        return
    slow = typed_rows.python_path(_rows(payloads), dict(columns), None, fixed)
    arrow, python = _columns(fast[0], columns), _columns(slow[0], columns)
    assert arrow.keys() == python.keys()
    for c in arrow:
        assert arrow[c][0] == python[c][0], c
        assert _same(arrow[c][1], python[c][1]), (c, arrow[c][1], python[c][1])
    assert fast[1].to_pylist() == slow[1].to_pylist()


def _taken(table: pa.Table | None, typed: Typed) -> pa.Table:
    """What a table holds after it takes `typed`, as lake/typed/event_tables.py writes it."""
    if table is None:
        return typed.rows
    changed = to_place_again(typed, lambda: table[shapes.OVERFLOW])
    if changed:
        before = regrown(table, typed.rows.schema, changed)
    else:  # appended: the new columns null in the earlier rows
        before = pa.table([table[f.name] if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
                           for f in typed.rows.schema], schema=typed.rows.schema)
    return pa.concat_tables([before, typed.rows])


def _by_name(table: pa.Table) -> dict[str, tuple[pa.DataType, list[Any]]]:
    """Each column's type and values; an object column's fields by name (their order follows the batches: Arrow's
    reader places a field where it first came, null or not; value by value, where it first held a value)."""
    out = {c: (_fields_sorted(table[c].type), table[c].to_pylist()) for c in table.column_names}
    t, texts = out[shapes.OVERFLOW]
    out[shapes.OVERFLOW] = (t, [None if x is None else json.loads(x) for x in texts])
    return out


def _fields_sorted(t: pa.DataType) -> pa.DataType:
    if pa.types.is_struct(t):
        return pa.struct(sorted((pa.field(f.name, _fields_sorted(f.type)) for f in t), key=lambda f: f.name))
    if pa.types.is_list(t):
        return pa.list_(_fields_sorted(t.value_type))
    return t


@settings(max_examples=int(os.environ.get("ES_PIPELINE_EXAMPLES", "500")), deadline=None)
@given(st.lists(_PAYLOAD | _REGULAR | st.sampled_from(["[1, 2]", "5", "null", "not json"]), min_size=1, max_size=8),
       st.lists(st.integers(min_value=1, max_value=7), max_size=3), _DECLARED)
@example([{"a": 1}, {"a": 1.5}, {"a": "x"}], [1, 2], None)  # a whole number, widened twice: `1` as text
@example([{"a": 2**60}, {"a": 1.5}, {"a": "x"}], [1, 2], None)  # out of a double column, into a string one
@example([{"a": None}, {"A": False}], [1], None)  # a name is taken by the first field of it with a value
@example([{"x": {"p": None, "q": False}}, {"x": {"p": False}}], [1], None)  # an object's fields in another order
def test_a_table_built_batch_by_batch_equals_one_built_at_once(payloads: list[Any], cuts: list[int],
                                                              declared: pa.Schema | None) -> None:
    bounds = sorted({0, len(payloads), *(c for c in cuts if c < len(payloads))})
    table: pa.Table | None = None
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        held = None if table is None else typed_rows.normal_schema_of(table)
        table = _taken(table, type_rows(_rows(payloads[lo:hi]), held, declared=declared))
    assert table is not None
    at_once = type_rows(_rows(payloads), None, declared=declared).rows
    assert _by_name(table) == _by_name(at_once)


@settings(max_examples=int(os.environ.get("ES_PIPELINE_EXAMPLES", "500")), deadline=None)
@given(st.lists(_PAYLOAD | _REGULAR | st.sampled_from(["[1, 2]", "5", "null", "not json"]), min_size=1, max_size=8),
       st.lists(st.integers(min_value=1, max_value=7), max_size=3), _DECLARED)
@example([{"a": 1}, {"a": {"b": 1}}, {"a": 1.5}], [1, 2], None)  # a kind that cannot meet, then one that widens
@example([{"a": None}, {"A": False}, {"a": 1}], [1, 2], None)  # a name taken across batches
def test_columns_found_by_parts_then_placed_equal_one_batch_at_once(payloads: list[Any], cuts: list[int],
                                                                   declared: pa.Schema | None) -> None:
    """The Spark build's two passes (lake/typed/on_spark.py): each part's (column, type) pairs replayed in order
    give the columns; every part typed against them adds and widens nothing, and together they equal one batch."""
    bounds = sorted({0, len(payloads), *(c for c in cuts if c < len(payloads))})
    columns, fixed = typed_rows.payload_columns(None, declared)
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        typed_rows.grow(columns, typed_rows.column_types(_rows(payloads[lo:hi]), declared=declared), fixed)
    schema = pa.schema([*typed_rows.ENVELOPE, *(pa.field(c, t) for c, t in columns.items())])
    parts = [type_rows(_rows(payloads[lo:hi]), schema, declared=declared) for lo, hi in zip(bounds, bounds[1:],
                                                                                            strict=False)]
    assert all(not p.added and not p.widened for p in parts)
    at_once = type_rows(_rows(payloads), None, declared=declared).rows
    assert _by_name(pa.concat_tables([p.rows for p in parts])) == _by_name(at_once)


# The four edges the rule settles, replayed (issue 40): each gives one answer, whatever the path.

def _typed(payloads: list[Any], declared: pa.Schema) -> list[dict[str, Any]]:
    return type_rows(_rows(payloads), None, declared=declared).rows.to_pylist()


def test_a_number_never_becomes_a_date_or_a_time() -> None:
    schema = pa.schema([("due", pa.date32()), ("at", pa.timestamp("us", tz="UTC"))])
    alone = _typed([{"due": 45000, "at": 1700000000}], schema)
    beside = _typed([{"due": 45000, "at": 1700000000}, {"due": "2024-05-01", "at": "2024-05-01T10:00:00"}], schema)
    for row in (alone[0], beside[0]):
        assert row["due"] is None and row["at"] is None
        assert json.loads(row["_overflow"]) == {"due": 45000, "at": 1700000000}
    assert beside[1]["due"] == dt.date(2024, 5, 1) and beside[1]["_overflow"] is None
    assert beside[1]["at"] == dt.datetime(2024, 5, 1, 10, tzinfo=dt.UTC)


def test_declared_maps_and_decimals_are_kept() -> None:
    schema = pa.schema([("tags", pa.map_(pa.string(), pa.int64())), ("price", pa.decimal128(10, 2))])
    rows = _typed([{"tags": {"a": 1, "b-c": 2}, "price": 12.5}, {"tags": {"a": "x"}, "price": "3.10"},
                   {"price": 1.234}], schema)
    assert rows[0]["tags"] == [("a", 1), ("b-c", 2)] and rows[0]["price"] == decimal.Decimal("12.50")
    assert rows[0]["_overflow"] is None and rows[1]["price"] == decimal.Decimal("3.10")
    assert json.loads(rows[1]["_overflow"]) == {"tags": {"a": "x"}}
    assert rows[2]["price"] is None and json.loads(rows[2]["_overflow"]) == {"price": 1.234}  # never rounded


def test_a_value_kept_in_overflow_moves_in_when_its_column_comes() -> None:
    table = None
    for batch in ([{"a": []}, {"a": {"x": None}}, {"a": 2**70}], [{"a": [1]}]):
        table = _taken(table, type_rows(_rows(batch), None if table is None else typed_rows.normal_schema_of(table)))
    assert table is not None and table["a"].to_pylist() == [[], None, None, [1]]
    assert [None if x is None else json.loads(x) for x in table[shapes.OVERFLOW].to_pylist()] == \
        [None, {"a": {"x": None}}, {"a": 2**70}, None]


def test_a_type_no_delta_table_holds_is_refused_when_declared() -> None:
    for t, says in ((pa.duration("s"), "no JSON value converts"), (pa.time64("us"), "no time of day type"),
                    (pa.uint32(), "no unsigned integers"), (pa.map_(pa.int64(), pa.int64()), "strings")):
        with pytest.raises(DomainError, match=says):
            Domain("d").event_schema("Timed", pa.schema([("took", t)]))
    held = Domain("d")
    held.event_schema("Timed", pa.schema([("at", pa.timestamp("ms", tz="Europe/Paris")), ("on", pa.date64())]))
    assert held.event_schemas["Timed"] == pa.schema([("at", pa.timestamp("us", tz="UTC")), ("on", pa.date32())])
