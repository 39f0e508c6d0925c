"""The shape of JSON payloads as Arrow columns: inference, widening, fitting (pure, no I/O).

What the typed event tables (lake/typed/event_tables.py) build on. The rule, in docs/analysts.md ("How a payload
becomes columns"):

- a JSON `true`/`false` is `boolean`, a whole number `bigint`, a number with a fraction or exponent `double`,
  a string `string`, an object a `struct` (its fields by the same rule), an array a `list` of its elements'
  type. `null` says nothing of a type and fits any column; nor do `[]`, `{}` and an object of nulls (their
  kind waits for a value): `[]` fits any list, `{}` any struct, and a null field is no field of a struct.
- **widening**: `bigint` and `double` make `double` (a whole number beyond 2**53, which a double would round, is
  then overflow); two different scalars (boolean, number, string) make
  `string`, the other values then held as their JSON text (`5`, `true`); two structs make the struct of both
  fields; two lists the list of both element types.
- an object whose keys are not all plain names (letters, digits, `_`; `"Content-Type"`) is held as its JSON text
  in a `string` column.
- **no fit**: a scalar against an object or an array, an object against an array, a whole number beyond 64
  bits in a number column: the value is kept whole in the row's `_overflow` (a JSON object), and counted. The
  column keeps its type. Where a column comes or widens later, the values `_overflow` kept for its field are
  placed again (lake/typed/typed_rows.py's `regrown`): a table holds the same whatever its batches were.
- a **declared** column (`domain.event_schema`) keeps its type; `declared_value` says which JSON values convert.
- a field's column is named as the field where that name is plain; an envelope column's name is taken by
  the envelope, so such a field becomes `payload_<name>`. Names that are not plain, and a field whose name
  differs only in case from another column's, are overflow: Delta's column names are case-insensitive.
"""

from __future__ import annotations

import base64
import binascii
import decimal
import json
import math
import re
from collections.abc import Iterable
from typing import Any

import orjson
import pyarrow as pa

UNKNOWN = pa.null()  # null: no type yet ([] is a list of UNKNOWN, {} a struct of no fields)
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1
_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
OVERFLOW = "_overflow"


class _Misfit:
    """The type of a value that fits no column of its own kind (a number beyond 64 bits)."""

    def __repr__(self) -> str:
        return "MISFIT"


MISFIT: Any = _Misfit()


def plain(name: str) -> bool:
    return bool(_PLAIN.match(name))


def infer(value: Any) -> Any:
    """The Arrow type a JSON value asks for: `UNKNOWN` where it says nothing of one (null, and `[]`, `{}` or an object
    of nulls: their kind waits for a value), `MISFIT` for an outsize integer. A field whose value is null is no
    field of the struct: only values give types, so a type never depends on where batches begin."""
    if value is None:
        return UNKNOWN
    if isinstance(value, bool):
        return pa.bool_()
    if isinstance(value, int):
        return pa.int64() if _INT_MIN <= value <= _INT_MAX else MISFIT
    if isinstance(value, float):
        return pa.float64()
    if isinstance(value, str):
        return pa.string()
    if isinstance(value, dict):
        if not _plain_keys(value):
            return pa.string()  # kept as its JSON text
        fields = [(k, infer(v)) for k, v in value.items()]
        if any(t is MISFIT for _, t in fields):
            return MISFIT
        known = [(k, t) for k, t in fields if t != UNKNOWN]
        return _struct(known) if known else UNKNOWN
    if isinstance(value, list):
        element = UNKNOWN
        for item in value:
            t = infer(item)
            merged = unify(element, t)
            if merged is None or t is MISFIT:
                return MISFIT
            element = merged
        return UNKNOWN if element == UNKNOWN else pa.list_(element)
    return MISFIT


def _plain_keys(value: dict) -> bool:
    lowered = {k.lower() for k in value}
    return len(lowered) == len(value) and all(plain(k) for k in value)


def _struct(fields: Iterable[tuple[str, Any]]) -> pa.DataType:
    return pa.struct([pa.field(k, t) for k, t in fields])


def _scalar(t: pa.DataType) -> bool:
    return pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_string(t)


def unify(a: Any, b: Any) -> Any:
    """The narrowest type both `a` and `b` widen to, or None where they cannot meet (the rule above)."""
    if a is MISFIT or b is MISFIT:
        return None
    if a == UNKNOWN:
        return b
    if b == UNKNOWN or a == b:
        return a
    if _scalar(a) and _scalar(b):
        numbers = {str(a), str(b)} <= {"int64", "double", "int32", "float"}
        return pa.float64() if numbers else pa.string()
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        held = {a.field(i).name: a.field(i).type for i in range(a.num_fields)}
        lowered = {n.lower(): n for n in held}
        for i in range(b.num_fields):
            f = b.field(i)
            name = lowered.get(f.name.lower(), f.name)
            if name != f.name:
                return None  # the same field in another case: no column holds both
            if name in held:
                merged = unify(held[name], f.type)
                if merged is None:
                    return None
                held[name] = merged
            else:
                held[name] = f.type
        return _struct(held.items())
    if pa.types.is_list(a) and pa.types.is_list(b):
        merged = unify(a.value_type, b.value_type)
        return None if merged is None else pa.list_(merged)
    return None


def fits(t: Any, column: pa.DataType) -> bool:
    """Whether a value of type `t` goes into `column` (as it is, or by the widening conversions)."""
    if t is MISFIT:
        return pa.types.is_string(column)
    return unify(column, t) == column


EXACT = 2**53  # whole numbers up to this size are exact as doubles


def places(value: Any, column: pa.DataType) -> bool:
    """Whether `value` goes into `column` exactly: as it is, or by the widening conversions (a scalar in a string
    column as its JSON text, a whole number in a double column), and nothing lost: no whole number beyond 2**53
    made a double (it would round), no field of an object left out but a null one."""
    if value is None:
        return True
    if pa.types.is_string(column):
        return isinstance(value, bool | int | float | str) or (isinstance(value, dict) and not _plain_keys(value))
    if pa.types.is_boolean(column):
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if pa.types.is_integer(column):
        return isinstance(value, int) and _INT_MIN <= value <= _INT_MAX
    if pa.types.is_floating(column):
        return isinstance(value, float) or (isinstance(value, int) and abs(value) <= EXACT)
    if pa.types.is_struct(column):
        if not isinstance(value, dict) or not _plain_keys(value):
            return False
        fields = {column.field(i).name: column.field(i).type for i in range(column.num_fields)}
        return all(v is None or (k in fields and places(v, fields[k])) for k, v in value.items())
    if pa.types.is_list(column):
        return isinstance(value, list) and all(places(v, column.value_type) for v in value)
    return False


def settled(t: Any) -> bool:
    """Whether `t` can be a column: no part of it still unknown (a list of nothing, a struct of no fields)."""
    if t is MISFIT or t == UNKNOWN:
        return False
    if pa.types.is_struct(t):
        return t.num_fields > 0 and all(settled(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t):
        return settled(t.value_type)
    return True


def convert(value: Any, column: pa.DataType) -> Any:
    """`value` (which `fits`) as `column` holds it: a number or boolean in a string column as its JSON text, a
    whole number in a double column as a float, a struct's missing fields as null."""
    if value is None:
        return None
    if pa.types.is_string(column):
        return value if isinstance(value, str) else scalar_text(value)
    if pa.types.is_floating(column):
        return float(value)
    if pa.types.is_struct(column):
        return {column.field(i).name: convert(value.get(column.field(i).name), column.field(i).type)
                for i in range(column.num_fields)}
    if pa.types.is_list(column):
        return [convert(v, column.value_type) for v in value]
    return value


def scalar_text(value: Any) -> str:
    """A value as a string column holds it: its JSON text, a whole number up to 2**53 without a fraction (`1`, be it
    written `1` or `1.0`: a double column holding it before a widening to `string` cannot tell)."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= EXACT:
        return str(int(value))
    return json_text(value)


def json_text(value: Any) -> str:
    """A value as JSON text (outsize integers as their digits; NaN and infinities as Python's json writes them,
    where orjson would write null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # an integer beyond 64 bits
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def column_name(field: str, envelope: frozenset[str]) -> str | None:
    """The column a payload field goes to, or None (overflow): the field's own name where plain, `payload_<name>`
    where the envelope holds the name (any case)."""
    if not plain(field):
        return None
    if field.lower() in envelope:
        field = f"payload_{field}"
        return field if plain(field) and field.lower() not in envelope else None
    return field


def sql_type(t: pa.DataType) -> str:
    """A column type as Spark SQL and DuckDB spell it (`bigint`, `struct<a: bigint>`, `array<string>`)."""
    if pa.types.is_struct(t):
        return "struct<" + ", ".join(f"{t.field(i).name}: {sql_type(t.field(i).type)}" for i in range(t.num_fields)) + ">"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"array<{sql_type(t.value_type)}>"
    names = {"int64": "bigint", "int32": "int", "double": "double", "float": "float", "bool": "boolean",
             "string": "string", "large_string": "string", "string_view": "string", "date32[day]": "date"}
    return names.get(str(t), str(t))


# A declared column (`domain.event_schema`) keeps its type: each JSON value converts to it by this rule, or is
# overflow. Numbers never become dates or times; nothing is rounded or cut.

def declared_value(value: Any, t: pa.DataType) -> tuple[bool, Any]:
    """(whether JSON value `value` goes into a declared column of type `t`, as what):

    - `boolean`: true/false; an integer type: a whole number in its range; a float type: a number (a whole one up
      to 2**53);
    - `string`: a string, or a number or boolean as its JSON text; `binary`: a string of base64;
    - `decimal(p, s)`: a number or a string of one, with at most `s` decimals and `p` digits (a number is read
      as a double first: its shortest form);
    - `date`: a string `YYYY-MM-DD`; `timestamp`: an ISO 8601 string (without an offset: UTC);
    - `struct`: an object of its fields (missing ones null); `list`: an array; `map<string, …>`: an object;
      each part by this rule."""
    if value is None:
        return True, None
    if pa.types.is_struct(t):
        fields = {t.field(i).name: t.field(i).type for i in range(t.num_fields)}
        if not isinstance(value, dict) or any(k not in fields for k, v in value.items() if v is not None):
            return False, None
        out = {}
        for name, field_type in fields.items():
            placed, out[name] = declared_value(value.get(name), field_type)
            if not placed:
                return False, None
        return True, out
    if pa.types.is_map(t):
        if not isinstance(value, dict):
            return False, None
        pairs = [(k, declared_value(v, t.item_type)) for k, v in value.items()]
        return (True, [(k, v) for k, (_, v) in pairs]) if all(ok for _, (ok, _) in pairs) else (False, None)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        if not isinstance(value, list):
            return False, None
        items = [declared_value(v, t.value_type) for v in value]
        return (True, [v for _, v in items]) if all(ok for ok, _ in items) else (False, None)
    if isinstance(value, dict | list):
        return False, None
    if pa.types.is_boolean(t):
        return (True, value) if isinstance(value, bool) else (False, None)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return True, value if isinstance(value, str) else scalar_text(value)
    if isinstance(value, bool):
        return False, None
    if pa.types.is_integer(t):
        return _in_range(value, t)
    if pa.types.is_floating(t):
        ok = isinstance(value, float) or (isinstance(value, int) and abs(value) <= EXACT)
        return (True, float(value)) if ok else (False, None)
    if pa.types.is_decimal(t):
        return _decimal(value, t)
    if not isinstance(value, str):
        return False, None  # numbers never become dates, times or bytes
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        try:
            return True, base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            return False, None
    return _cast_text(value, t)  # a date or a timestamp, as Arrow casts the string


def _in_range(value: Any, t: pa.DataType) -> tuple[bool, Any]:
    if not isinstance(value, int):
        return False, None
    bits = t.bit_width
    low, high = (0, 2**bits - 1) if pa.types.is_unsigned_integer(t) else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return (True, value) if low <= value <= high else (False, None)


def _decimal(value: Any, t: pa.DataType) -> tuple[bool, Any]:
    try:
        number = decimal.Decimal(repr(value) if isinstance(value, float) else str(value).strip())
    except decimal.InvalidOperation:
        return False, None
    if not number.is_finite():
        return False, None
    step = decimal.Decimal(1).scaleb(-t.scale)
    try:
        exact = number.quantize(step, context=decimal.Context(prec=t.precision))
    except decimal.InvalidOperation:
        return False, None  # more digits than the precision holds
    if exact != number or len(exact.as_tuple().digits) > t.precision:
        return False, None  # a decimal beyond the scale would be rounded
    return True, exact


def _cast_text(value: str, t: pa.DataType) -> tuple[bool, Any]:
    """A string as a date or timestamp by Arrow's cast (a timestamp with a time zone takes an ISO string with an
    offset, or one without as UTC: the second route, which only a string without an offset takes)."""
    for route in ([t], [pa.timestamp(t.unit), t]) if pa.types.is_timestamp(t) and t.tz else ([t],):
        try:
            array: pa.Array = pa.array([value], pa.string())
            for step in route:
                array = array.cast(step)
            return True, array.to_pylist()[0]
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            continue
    return False, None


def cast_texts(values: pa.Array, t: pa.DataType) -> pa.Array | None:
    """A column of strings (and nulls) as dates or timestamps by the rule of `_cast_text`, whole, or None where some
    value takes another route or none (the caller then goes value by value)."""
    for route in ([t], [pa.timestamp(t.unit), t]) if pa.types.is_timestamp(t) and t.tz else ([t],):
        try:
            array = values
            for step in route:
                array = array.cast(step)
            return array
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            continue
    return None
