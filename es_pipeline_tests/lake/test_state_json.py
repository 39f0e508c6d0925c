"""A state's JSON text and back (lake/state/state_json.py): natural Python values of declared fields round-trip, and a
state that does not fit names its field (pure)."""

from __future__ import annotations

import datetime as dt
import decimal
import json

import pyarrow as pa
import pytest

from es_pipeline.lake.state.state_json import Codec, StateMisfit, columns

_SCHEMA = pa.schema([
    ("at", pa.timestamp("us", tz="UTC")), ("local", pa.timestamp("us")), ("on", pa.date32()),
    ("price", pa.decimal128(10, 2)), ("blob", pa.binary()), ("tags", pa.map_(pa.string(), pa.date32())),
    ("visits", pa.list_(pa.struct([("at", pa.timestamp("us", tz="UTC")), ("n", pa.int64())]))),
    ("name", pa.string()), ("maybe", pa.float64()),
])


def test_declared_values_round_trip_through_json_and_become_columns() -> None:
    paris = dt.timezone(dt.timedelta(hours=1))
    state = {"at": dt.datetime(2026, 11, 27, 10, 0, 0, 123456, tzinfo=paris), "local": dt.datetime(2026, 1, 1, 8),
             "on": dt.date(2026, 2, 3), "price": decimal.Decimal("12.50"), "blob": b"\x00\xff",
             "tags": {"due": dt.date(2026, 3, 4)}, "visits": [{"at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC), "n": 2}],
             "name": "x", "maybe": None, "undeclared": [1, "two"]}
    codec = Codec(_SCHEMA)
    text = codec.dumps(state)
    assert json.loads(text)["at"] == "2026-11-27T09:00:00.123456+00:00" and json.loads(text)["price"] == "12.50"
    back = codec.loads(text)
    assert back == {**state, "at": state["at"].astimezone(dt.UTC)} and back["at"].tzinfo == dt.UTC
    assert type(back["price"]) is decimal.Decimal and back["visits"][0]["at"] == state["visits"][0]["at"]
    row = columns([json.loads(text)], _SCHEMA).to_pylist()[0]
    assert row["at"] == state["at"] and row["on"] == state["on"] and row["price"] == decimal.Decimal("12.50")
    assert row["blob"] == b"\x00\xff" and row["tags"] == [("due", dt.date(2026, 3, 4))] and row["maybe"] is None


@pytest.mark.parametrize(("state", "field", "says"), [
    ({"at": "2026-11-27T10:00:00Z"}, "at", "declared a datetime: return a datetime"),
    ({"at": 1_700_000_000}, "at", "declared a datetime"),
    ({"local": dt.datetime(2026, 1, 1, tzinfo=dt.UTC)}, "local", "return a naive datetime"),
    ({"on": dt.datetime(2026, 1, 1)}, "on", "return a datetime.date"),
    ({"price": decimal.Decimal("1.234")}, "price", "more digits"),
    ({"price": 12.5}, "price", "return a decimal.Decimal"),
    ({"visits": [{"at": None, "n": "2"}]}, "visits[0].n", "declared bigint"),
    ({"visits": [{"n": 1, "extra": 1}]}, "visits[0].extra", "no field for"),
    ({"tags": {"a": "2026-01-01"}}, "tags['a']", "return a datetime.date"),
    ({"undeclared": {"when": dt.date(2026, 1, 1)}}, "undeclared.when", "no JSON form"),
])
def test_a_state_that_does_not_fit_names_the_field_and_what_to_return(state: dict, field: str, says: str) -> None:
    with pytest.raises(StateMisfit) as caught:
        Codec(_SCHEMA).dumps(state)
    assert caught.value.field == field and says in str(caught.value)
