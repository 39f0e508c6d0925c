"""The shape of JSON payloads as Arrow columns: inference, widening, fitting (pure, no I/O).

What the typed event tables (lake/event_tables.py) build on. The rule, in docs/analysts.md ("How a payload
becomes columns"):

- a JSON `true`/`false` is `boolean`, a whole number `bigint`, a number with a fraction or exponent `double`,
  a string `string`, an object a `struct` (its fields by the same rule), an array a `list` of its elements'
  type. `null` says nothing of a type and fits any column; `[]` fits any list, `{}` any struct.
- **widening**: `bigint` and `double` make `double` (a whole number beyond 2**53, which a double would round, is
  then overflow); two different scalars (boolean, number, string) make
  `string`, the other values then held as their JSON text (`5`, `true`); two structs make the struct of both
  fields; two lists the list of both element types.
- an object whose keys are not all plain names (letters, digits, `_`; `"Content-Type"`) is held as its JSON text
  in a `string` column.
- **no fit**: a scalar against an object or an array, an object against an array, a whole number beyond 64
  bits in a number column: the value is kept whole in the row's `_overflow` (a JSON object), and counted. The
  column keeps its type.
- a field's column is named as the field where that name is plain; an envelope column's name is taken by
  the envelope, so such a field becomes `payload_<name>`. Names that are not plain, and a field whose name
  differs only in case from another column's, are overflow: Delta's column names are case-insensitive.
"""

from __future__ import annotations

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
    """The Arrow type a JSON value asks for (`UNKNOWN` for null, [] and {}; `MISFIT` for an outsize integer)."""
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
        if not value:
            return pa.struct([])  # an object: its fields unknown
        if not _plain_keys(value):
            return pa.string()  # kept as its JSON text
        fields = [(k, infer(v)) for k, v in value.items()]
        if any(t is MISFIT for _, t in fields):
            return MISFIT
        return _struct(fields)
    if isinstance(value, list):
        element = UNKNOWN
        for item in value:
            t = infer(item)
            merged = unify(element, t)
            if merged is None or t is MISFIT:
                return MISFIT
            element = merged
        return pa.list_(element)
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
    """Whether `value` goes into `column` exactly: it `fits`, and a whole number beyond 2**53 is not made a double
    (which would round it): such a value is overflow, kept whole."""
    if not fits(infer(value), column):
        return False
    return not _rounds(value, column)


def _rounds(value: Any, column: pa.DataType) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return pa.types.is_floating(column) and abs(value) > EXACT
    if isinstance(value, dict) and pa.types.is_struct(column):
        return any(_rounds(value.get(column.field(i).name), column.field(i).type) for i in range(column.num_fields))
    if isinstance(value, list) and pa.types.is_list(column):
        return any(_rounds(v, column.value_type) for v in value)
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


def pinned(t: pa.DataType) -> pa.DataType:
    """`t` with every part still unknown given a type (`string`), so that it can be a column."""
    if t == UNKNOWN:
        return pa.string()
    if pa.types.is_struct(t):
        return _struct((t.field(i).name, pinned(t.field(i).type)) for i in range(t.num_fields))
    if pa.types.is_list(t):
        return pa.list_(pinned(t.value_type))
    return t


def convert(value: Any, column: pa.DataType) -> Any:
    """`value` (which `fits`) as `column` holds it: a number or boolean in a string column as its JSON text, a
    whole number in a double column as a float, a struct's missing fields as null."""
    if value is None:
        return None
    if pa.types.is_string(column):
        return value if isinstance(value, str) else json_text(value)
    if pa.types.is_floating(column):
        return float(value)
    if pa.types.is_struct(column):
        return {column.field(i).name: convert(value.get(column.field(i).name), column.field(i).type)
                for i in range(column.num_fields)}
    if pa.types.is_list(column):
        return [convert(v, column.value_type) for v in value]
    return value


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


def widen_column(values: pa.ChunkedArray | pa.Array, to: pa.DataType) -> pa.Array | pa.ChunkedArray:
    """A column of a table's older rows as type `to` (which its type widens to): Arrow's cast where it gives the
    same text as JSON would (numbers, booleans), else value by value."""
    held = values.type
    if held == to:
        return values
    if pa.types.is_string(to) and (pa.types.is_integer(held) or pa.types.is_boolean(held)):
        return values.cast(to)
    if pa.types.is_floating(to) and pa.types.is_integer(held):
        return values.cast(to, safe=False)  # beyond 2**53 to the nearest double, as JSON readers do
    return pa.array([convert(v, to) for v in values.to_pylist()], type=to)
