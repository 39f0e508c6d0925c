"""The payload rule (lake/typed/shapes.py) and the typed event tables' names: pure, no I/O."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from es_pipeline.lake.typed import shapes
from es_pipeline.lake.typed.event_tables import table_name
from es_pipeline.lake.typed.typed_rows import ENVELOPE, regrown
from es_pipeline_tests.support.lakecheck import same_value

ENVELOPE_NAMES = frozenset(n.lower() for n in ENVELOPE.names)


def test_each_json_value_asks_for_its_type() -> None:
    assert shapes.infer(True) == pa.bool_()
    assert shapes.infer(3) == pa.int64()
    assert shapes.infer(2.5) == pa.float64()
    assert shapes.infer("x") == pa.string()
    assert shapes.infer({"a": 1, "b": [1.5]}) == pa.struct([("a", pa.int64()), ("b", pa.list_(pa.float64()))])
    assert shapes.infer({"odd key": 1}) == pa.string()  # kept as JSON text
    assert shapes.infer(None) == shapes.UNKNOWN
    assert shapes.infer([]) == shapes.UNKNOWN and not shapes.places([], pa.bool_()) and shapes.places([], pa.list_(pa.int64()))
    assert shapes.infer({}) == shapes.UNKNOWN and shapes.places({}, pa.struct([("a", pa.int64())]))
    assert shapes.infer({"a": None, "b": 1}) == pa.struct([("b", pa.int64())])  # a null field is no field
    assert shapes.places({"a": None, "b": 1}, pa.struct([("b", pa.int64())]))
    assert not shapes.places({"a": [], "b": 1}, pa.struct([("b", pa.int64())]))  # nothing left out but nulls
    assert shapes.infer(2**64) is shapes.MISFIT


def test_widening_follows_the_rule() -> None:
    assert shapes.unify(pa.int64(), pa.float64()) == pa.float64()
    assert shapes.unify(pa.bool_(), pa.int64()) == pa.string()
    assert shapes.unify(pa.float64(), pa.string()) == pa.string()
    assert shapes.unify(pa.struct([("a", pa.int64())]), pa.struct([("b", pa.string())])) == \
        pa.struct([("a", pa.int64()), ("b", pa.string())])
    assert shapes.unify(pa.list_(pa.int64()), pa.list_(pa.float64())) == pa.list_(pa.float64())
    # No column holds both: the value that came second is overflow.
    assert shapes.unify(pa.int64(), pa.struct([("a", pa.int64())])) is None
    assert shapes.unify(pa.list_(pa.int64()), pa.string()) is None
    assert shapes.unify(pa.struct([("a", pa.int64())]), pa.struct([("A", pa.int64())])) is None
    # An outsize integer fits a string column (as its digits), no number column.
    assert shapes.fits(shapes.MISFIT, pa.string()) and not shapes.fits(shapes.MISFIT, pa.float64())


def test_values_convert_to_the_column_they_fit() -> None:
    assert shapes.convert(5, pa.string()) == "5"
    assert shapes.convert(True, pa.string()) == "true"
    assert shapes.convert({"x": 1}, pa.string()) == '{"x":1}'
    assert shapes.convert(2, pa.float64()) == 2.0
    assert shapes.convert({"a": 1}, pa.struct([("a", pa.int64()), ("b", pa.string())])) == {"a": 1, "b": None}
    assert shapes.convert(2**70, pa.string()) == str(2**70)


def test_older_rows_are_placed_again_as_json_would_write_them() -> None:
    before = pa.table({"a": pa.array([1, 2**60, None]), "b": pa.array([True, None, None]),
                       shapes.OVERFLOW: pa.array([None, None, '{"a":"x"}'])})
    schema = pa.schema([("a", pa.float64()), ("b", pa.string()), (shapes.OVERFLOW, pa.string())])
    after = regrown(before, schema, {"a": pa.float64(), "b": pa.string()})
    assert after["a"].to_pylist() == [1.0, None, None] and after["b"].to_pylist() == ["true", None, None]
    assert after[shapes.OVERFLOW].to_pylist() == [None, '{"a":1152921504606846976}', '{"a":"x"}']  # no digit lost
    as_text = regrown(after, schema.set(0, pa.field("a", pa.string())), {"a": pa.string()})
    assert as_text["a"].to_pylist() == ["1", "1152921504606846976", "x"]  # a column of text takes them all
    assert as_text[shapes.OVERFLOW].to_pylist() == [None, None, None]


def test_column_names_are_the_fields_where_plain() -> None:
    assert shapes.column_name("unitPrice", ENVELOPE_NAMES) == "unitPrice"
    assert shapes.column_name("version", ENVELOPE_NAMES) == "payload_version"  # the envelope's name
    assert shapes.column_name("Tenant", ENVELOPE_NAMES) == "payload_Tenant"
    assert shapes.column_name("item-id", ENVELOPE_NAMES) is None
    assert shapes.column_name("a b", ENVELOPE_NAMES) is None


def test_table_names_are_predictable_from_any_spelling() -> None:
    for spelling in ("ItemAdded", "item_added", "item-added", "item.added", "ITEM_ADDED"):
        assert table_name(spelling) == "events_item_added", spelling
    assert table_name("HTTPRequestSent") == "events_http_request_sent"
    assert table_name("Cart.ItemAdded.v2") == "events_cart_item_added_v2"
    assert table_name("---") == "events__"
    long = table_name("X" * 300)
    assert long.startswith("events_") and len(long) <= 90


_json = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_json, min_size=1, max_size=6))
def test_every_value_either_fits_the_widened_column_exactly_or_is_overflow(values: list[Any]) -> None:
    column = shapes.UNKNOWN
    for v in values:
        merged = shapes.unify(column, shapes.infer(v))
        column = column if merged is None else merged
    if column == shapes.UNKNOWN:
        return
    kept = [v for v in values if shapes.places(v, column)]
    array = pa.array([shapes.convert(v, column) for v in kept], type=column)  # Arrow takes each as the column's type
    for held, v in zip(array.to_pylist(), kept, strict=True):
        assert same_value(held, v), (held, v, column)  # exactly: no digit lost
    first = next((v for v in values if shapes.infer(v) not in (shapes.UNKNOWN, shapes.MISFIT)), None)
    if first is not None:  # the first value with a type has a place, unless a double would round it
        assert shapes.fits(shapes.infer(first), column)
