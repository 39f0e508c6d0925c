"""A state as JSON text and back, by its declared fields (pure, no I/O).

A reducer (or a cross-stream projection's fold) returns a dict of natural Python values. Its JSON text is what
`stream_state.state` and a projection's `state` column hold, what the next run's fold starts from, and what its
typed table's columns are read from (by the rule of lake/typed/shapes.py's `declared_value`). So that the next run's
fold sees what this run's saw, whatever the batches:

- a field the team **declared** (`state=`) as `datetime`, `date`, a decimal or `bytes` holds that Python type
  (a `datetime` with a time zone where the declared one has one; a `Decimal`), is written as a string (ISO 8601
  in UTC, ISO date, the decimal's digits, base64) and read back as that type: the moment round-trips, in UTC;
- every other declared field holds what its column's rule takes (an `int` for `int`, a `dict` for a nested
  dataclass or a `dict[str, …]`, a `list` for `list[…]`, `None` for `X | None`);
- an undeclared field holds a JSON value; a `datetime` there would come back as a string, so it is refused
  with the field's name: declare it.

A state that does not fit raises `StateMisfit` naming the field, the value's type and what to return instead.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
from collections.abc import Callable
from typing import Any

import orjson
import pyarrow as pa

from es_pipeline.lake.typed import shapes


class StateMisfit(ValueError):
    """A state that does not fit: its field (a dotted path), the value there, and what to do."""

    def __init__(self, field: str, value: Any, reason: str, index: int = 0) -> None:
        self.field, self.value, self.reason, self.index = field, value, reason, index  # index: which of many states
        super().__init__(f"its state's field {field!r} holds a {type(value).__name__} ({reason})")


def _special(t: pa.DataType) -> bool:
    """Whether values of type `t` (or of a part of it) are no JSON value in the fold: times, decimals, bytes."""
    if pa.types.is_struct(t):
        return any(_special(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _special(t.value_type)
    if pa.types.is_map(t):
        return _special(t.item_type)
    return pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_decimal(t) or pa.types.is_binary(t)


class Codec:
    """A state's JSON text and back, for one declaration (None: no declared fields)."""

    def __init__(self, schema: pa.Schema | None) -> None:
        self.fields = [] if schema is None else [(f.name, f.type, _fits(f.type)) for f in schema]
        self.special = [(n, t) for n, t, _ in self.fields if _special(t)]

    def to_json(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` with its declared fields checked and in their JSON form (a copy where one changed)."""
        if not isinstance(state, dict):
            raise StateMisfit("", state, "a state is a dict: return a dict")
        out = state
        for name, t, fits in self.fields:
            value = state.get(name)
            if value is None or (fits is not None and fits(value)):
                continue  # the common case, checked at once: a JSON value of the field's own kind
            held = _to_json(value, t, name)
            if held is not value:
                if out is state:
                    out = dict(state)
                out[name] = held
        return out

    def dumps(self, state: dict[str, Any]) -> str:
        """The JSON text of `state` (keys sorted, compact), or `StateMisfit`."""
        return self.text(self.to_json(state))

    @staticmethod
    def text(held: dict[str, Any]) -> str:
        """The JSON text of a state in its JSON form (`to_json`'s), or `StateMisfit` naming a value JSON has no
        form for."""
        try:
            return json.dumps(held, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError):
            field, value = _first_non_json(held, "")
            raise StateMisfit(field, value, "it has no JSON form: hold a JSON value there, or declare the field "
                                            "(state=) as datetime, date, Decimal or bytes") from None

    def trail_text(self, state: dict[str, Any]) -> str:
        """`dumps`, faster, for the history's rows (lake/state/history.py): orjson's text where it is exactly
        `json.dumps`' (ASCII, no null, no float in exponent or with four zeros after the point), else `dumps`'
        own. It differs only where `dumps` refuses a value orjson has a form for (a UUID, a plain Enum): the
        history keeps that form; the next fold never reads a history row."""
        held = self.to_json(state)
        try:
            out = orjson.dumps(held, option=_FAST)
        except TypeError:
            return self.text(held)
        if out.isascii() and b"\x7f" not in out and b"null" not in out and b"0.0000" not in out and b"e-" not in out:
            return out.decode()
        return self.text(held)

    def loads(self, text: str) -> dict[str, Any]:
        """A state's JSON text as the fold continues from it: the declared times, decimals and bytes as such."""
        try:
            state = orjson.loads(text)
        except orjson.JSONDecodeError:
            state = json.loads(text)  # integers past 64 bits, NaN
        for name, t in self.special:
            value = state.get(name)
            if value is not None:
                state[name] = _from_json(value, t)
        return state


_CODECS: dict[int, tuple[pa.Schema | None, Codec]] = {}
# Keys sorted as json.dumps sorts them; datetimes, dataclasses and subclasses of str, int, dict and list left to
# json.dumps (a TypeError here), which refuses or writes them its own way.
_FAST = orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS | \
    orjson.OPT_PASSTHROUGH_SUBCLASS


def codec(schema: pa.Schema | None) -> Codec:
    """The codec of a declaration (one per declaration object and process: a fold asks once per stream)."""
    held = _CODECS.get(id(schema))
    if held is None or held[0] is not schema:
        held = _CODECS[id(schema)] = (schema, Codec(schema))
    return held[1]


def _to_json(value: Any, t: pa.DataType, path: str) -> Any:
    if value is None:
        return None
    if pa.types.is_timestamp(t):
        if not isinstance(value, dt.datetime):
            raise StateMisfit(path, value, "declared a datetime: return a datetime")
        if (value.tzinfo is None) != (t.tz is None):
            raise StateMisfit(path, value, "a datetime without a time zone: give it one (datetime.now(UTC))"
                              if t.tz else "declared without a time zone: return a naive datetime")
        return (value.astimezone(dt.UTC) if t.tz else value).isoformat()
    if pa.types.is_date(t):
        if not isinstance(value, dt.date) or isinstance(value, dt.datetime):
            raise StateMisfit(path, value, "declared a date: return a datetime.date")
        return value.isoformat()
    if pa.types.is_decimal(t):
        if not isinstance(value, decimal.Decimal):
            raise StateMisfit(path, value, "declared a decimal: return a decimal.Decimal")
        if not shapes.declared_value(str(value), t)[0]:
            raise StateMisfit(path, value, f"more digits than {t} holds, or a NaN")
        return str(value)
    if pa.types.is_binary(t):
        if not isinstance(value, bytes):
            raise StateMisfit(path, value, "declared bytes: return bytes")
        return base64.b64encode(value).decode()
    if pa.types.is_struct(t):
        if not isinstance(value, dict):
            raise StateMisfit(path, value, "declared a nested record: return a dict of its fields")
        fields = {t.field(i).name: t.field(i).type for i in range(t.num_fields)}
        extra = [k for k, v in value.items() if k not in fields and v is not None]
        if extra:
            raise StateMisfit(f"{path}.{extra[0]}", value[extra[0]], "a key the declared record has no field for")
        return _changed(value, {k: _to_json(v, fields[k], f"{path}.{k}") for k, v in value.items() if k in fields})
    if pa.types.is_map(t):
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise StateMisfit(path, value, "declared a dict[str, …]: return a dict with string keys")
        return _changed(value, {k: _to_json(v, t.item_type, f"{path}[{k!r}]") for k, v in value.items()})
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        if not isinstance(value, list):
            raise StateMisfit(path, value, "declared a list: return a list")
        items = [_to_json(v, t.value_type, f"{path}[{i}]") for i, v in enumerate(value)]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    if not shapes.declared_value(value, t)[0]:
        raise StateMisfit(path, value, f"declared {shapes.sql_type(t)}: return a value of that type")
    return value


def _changed(value: dict[str, Any], held: dict[str, Any]) -> dict[str, Any]:
    """`value` itself where converting changed none of its items, else the converted copy (undeclared nulls too)."""
    if all(held[k] is value[k] for k in held):
        return value
    return {**value, **held}


def _from_json(value: Any, t: pa.DataType) -> Any:
    if value is None:
        return None
    if pa.types.is_timestamp(t):
        return dt.datetime.fromisoformat(value)
    if pa.types.is_date(t):
        return dt.date.fromisoformat(value)
    if pa.types.is_decimal(t):
        return decimal.Decimal(value)
    if pa.types.is_binary(t):
        return base64.b64decode(value)
    if pa.types.is_struct(t):
        fields = {t.field(i).name: t.field(i).type for i in range(t.num_fields)}
        return {k: _from_json(v, fields[k]) if k in fields else v for k, v in value.items()}
    if pa.types.is_map(t):
        return {k: _from_json(v, t.item_type) for k, v in value.items()}
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return [_from_json(v, t.value_type) for v in value]
    return value


def _first_non_json(value: Any, path: str) -> tuple[str, Any]:
    """The path of the first value in `value` that JSON cannot write (a dotted path; `[i]` for list items)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str | int | float | bool) and k is not None:
                return f"{path}.{k!r}".lstrip("."), k
            found = _first_non_json(v, f"{path}.{k}".lstrip("."))
            if found[0] != "":
                return found
        return "", None
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            found = _first_non_json(v, f"{path}[{i}]")
            if found[0] != "":
                return found
        return "", None
    if value is None or isinstance(value, str | int | float | bool):
        return "", None
    return path or "(the state)", value


def columns(states: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """The declared fields of states in their JSON form (`to_json`, or read from the JSON text) as the typed table's
    columns, by the rule of `shapes.declared_value`; `StateMisfit` names the first field that does not convert
    (`index` on it: which state)."""
    return columns_of_values([[s.get(f.name) for s in states] for f in schema], schema)


def columns_of_values(fields: list[list[Any]], schema: pa.Schema) -> pa.Table:
    """As `columns`, from each declared field's values (in their JSON form) in the order of `schema`."""
    out = []
    for f, values in zip(schema, fields, strict=True):
        array = _exactly(values, f.type)
        if array is None:
            held = []
            for i, v in enumerate(values):
                placed, converted = shapes.declared_value(v, f.type)
                if not placed:
                    raise StateMisfit(f.name, v, f"declared {shapes.sql_type(f.type)}", i)
                held.append(converted)
            array = pa.array(held, type=f.type)
        out.append(array)
    return pa.Table.from_arrays(out, schema=schema)


_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1
_PLAIN: dict[pa.DataType, Callable[[Any], bool]] = {
    pa.string(): lambda v: type(v) is str, pa.int64(): lambda v: type(v) is int and _INT_MIN <= v <= _INT_MAX,
    pa.float64(): lambda v: type(v) is float or (type(v) is int and -shapes.EXACT <= v <= shapes.EXACT),
    pa.bool_(): lambda v: type(v) is bool,
}


def _fits(t: pa.DataType) -> Callable[[Any], bool] | None:
    """A quick test that a (non-null) value fits type `t` as it is, for a type of strings, 64-bit integers,
    doubles, booleans and maps, lists and structs of them (None for other types: `_to_json` looks at each value).
    False says only "look closer": `_to_json` and `declared_value` decide."""
    plain = _PLAIN.get(t)
    if plain is not None:
        return plain
    if pa.types.is_map(t):
        item = _fits(t.item_type)
        if item is None:
            return None
        return lambda v: type(v) is dict and all(type(k) is str and (x is None or item(x)) for k, x in v.items())
    if pa.types.is_list(t):
        element = _fits(t.value_type)
        if element is None:
            return None
        return lambda v: type(v) is list and all(x is None or element(x) for x in v)
    if pa.types.is_struct(t):
        fields = {t.field(i).name: _fits(t.field(i).type) for i in range(t.num_fields)}
        if any(f is None for f in fields.values()):
            return None
        return lambda v: type(v) is dict and all(x is None or (k in fields and fields[k](x))  # type: ignore[misc]
                                                 for k, x in v.items())
    return None


def _exactly(values: list[Any], t: pa.DataType) -> pa.Array | None:
    """`values` as a column of type `t` at once, where each fits as it is (`_fits`: the rule takes it as it is),
    else None (then value by value)."""
    fits = _fits(t)
    if fits is None or not all(v is None or fits(v) for v in values):
        return None
    return pa.array(values, type=t)
