"""One event type's rows as its typed table holds them: the envelope, `_overflow`, a column per payload field.

The rule (lake/shapes.py) applied to a batch of `events` rows of one type, against the columns its table has:
Arrow's JSON reader where it gives exactly what the rule says (the common case: every payload fits the
columns, or adds plain new ones), value by value in Python for the rest (upcasters, declared payloads, a field
that changed kind, odd names, outsize numbers). What the table does with the result (append, add columns,
rewrite a widened one) is lake/event_tables.py's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
from deltalake import DeltaTable

from es_pipeline.domain import Domain, Event
from es_pipeline.lake import shapes

_AT = pa.timestamp("us", tz="UTC")
ENVELOPE = pa.schema([
    ("tenant", pa.string()), ("stream_id", pa.string()), ("stream_type", pa.string()), ("version", pa.int32()),
    ("event_type", pa.string()), ("recorded_at", _AT), ("event_date", pa.date32()), ("tx_id", pa.int64()),
    ("global_position", pa.int64()), (shapes.OVERFLOW, pa.string()),
])
_ENVELOPE_NAMES = frozenset(n.lower() for n in ENVELOPE.names)


@dataclass
class Typed:
    """One type's rows as its table holds them, and how the table's columns changed."""

    rows: pa.Table
    added: list[str] = field(default_factory=list)
    widened: dict[str, tuple[pa.DataType, pa.DataType]] = field(default_factory=dict)
    overflowed: int = 0
    first_at: dict[str, Any] = field(default_factory=dict)  # column → the recorded time of its first value here


def normal_schema(table: DeltaTable) -> pa.Schema:
    """A Delta table's schema as this module compares types: plain strings and lists, nullable fields."""
    return pa.schema([pa.field(f.name, _normal(f.type)) for f in pa.schema(table.schema().to_arrow())])


def _normal(t: pa.DataType) -> pa.DataType:
    if t in (pa.string_view(), pa.large_string()):
        return pa.string()
    if pa.types.is_struct(t):
        return pa.struct([pa.field(t.field(i).name, _normal(t.field(i).type)) for i in range(t.num_fields)])
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t):
        return pa.list_(_normal(t.value_type))
    return t


def type_rows(rows: pa.Table, held: pa.Schema | None, *, domain: Domain | None = None,
              declared: pa.Schema | None = None) -> Typed:
    """`rows` (events of one type: the `_READ` columns) as typed rows for a table whose schema is `held` (None: a
    new table). Arrow's JSON reader takes the common case (every payload fits the columns, or adds plain new
    ones); anything it cannot take exactly goes value by value (lake/shapes.py). `domain`: upcast each payload
    first; `declared`: the team's schema of the payloads, whose columns keep their declared types."""
    columns = {} if held is None else {f.name: f.type for f in held if f.name not in ENVELOPE.names}
    fixed: dict[str, pa.DataType] = {}
    for f in declared or ():
        column = shapes.column_name(f.name, _ENVELOPE_NAMES)
        if column is not None:
            fixed[column] = columns.setdefault(column, f.type)
    fast = None if domain is not None else _arrow_path(rows, columns, fixed)
    payload_cols, overflow, overflowed = fast if fast is not None else _python_path(rows, columns, domain, fixed)
    envelope = _envelope(rows, overflow)
    held_names = set() if held is None else set(held.names)
    order = [*columns, *(c for c in payload_cols if c not in columns)]
    out = pa.table([*envelope.columns, *(payload_cols[c] if c in payload_cols else pa.nulls(rows.num_rows, columns[c])
                                        for c in order)],
                   names=[*envelope.column_names, *order])
    typed = Typed(out, overflowed=overflowed)
    typed.added = [c for c in order if c not in held_names]
    typed.widened = {c: (columns[c], payload_cols[c].type) for c in columns
                     if c in payload_cols and payload_cols[c].type != columns[c]}
    recorded = rows["recorded_at"]
    for c in [*typed.added, *typed.widened, *([shapes.OVERFLOW] if held is None else [])]:
        values = out[c]
        valid = pc.is_valid(values)
        typed.first_at[c] = pc.min(recorded.filter(valid)).as_py() if pc.any(valid).as_py() else pc.min(recorded).as_py()
    return typed


def _envelope(rows: pa.Table, overflow: pa.Array) -> pa.Table:
    arrays = []
    for f in ENVELOPE:
        if f.name == shapes.OVERFLOW:
            arrays.append(overflow)
        elif f.name in rows.column_names:
            arrays.append(rows[f.name].cast(f.type))
        else:
            arrays.append(pa.nulls(rows.num_rows, f.type))
    return pa.table(arrays, schema=ENVELOPE)


def field_of(column: str) -> str:
    """The payload field a column holds (`payload_version` holds `version`, which the envelope's name takes)."""
    if column.startswith("payload_") and column[len("payload_"):].lower() in _ENVELOPE_NAMES:
        return column[len("payload_"):]
    return column


def column_for(field: str, columns: Iterable[str]) -> str | None:
    """The column of `columns` that holds payload field `field`, if any."""
    column = shapes.column_name(field, _ENVELOPE_NAMES)
    return column if column is not None and column in columns and field_of(column) == field else None


_OUTSIZE = float(shapes.EXACT)  # a double this large may be a whole number Arrow's reader rounded: value by value


def _arrow_path(rows: pa.Table, columns: dict[str, pa.DataType],
                fixed: dict[str, pa.DataType]) -> tuple[dict[str, Any], pa.Array, int] | None:
    """The payload columns by Arrow's JSON reader, or None where it cannot give exactly what the rule says."""
    payload = rows["payload"]
    if "payload_encoding" in rows.column_names and not pc.all(pc.fill_null(pc.equal(
            rows["payload_encoding"], "json"), True)).as_py():
        return None
    if rows.num_rows == 0 or pc.any(pc.is_null(payload)).as_py() or pc.any(pc.match_substring(payload, "\n")).as_py() \
            or pc.any(pc.equal(payload, "null")).as_py():  # a payload `null` is kept as {"$payload": null}
        return None
    explicit = pa.schema([(field_of(c), t) for c, t in columns.items()])
    text = pc.binary_join(pa.LargeListArray.from_arrays(pa.array([0, len(payload)], pa.int64()),
                                                        payload.combine_chunks().cast(pa.large_binary())),
                          pa.scalar(b"\n", pa.large_binary()))
    try:
        read = pj.read_json(pa.BufferReader(text[0].as_buffer()), parse_options=pj.ParseOptions(
            explicit_schema=explicit, unexpected_field_behavior="infer"))
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None
    if read.num_rows != rows.num_rows:
        return None
    out: dict[str, Any] = {}
    lowered = {c.lower() for c in columns}
    for f in read.schema:
        column = f.name if f.name in explicit.names else shapes.column_name(f.name, _ENVELOPE_NAMES)
        if column is None or not (_lattice(f.type) or f.name in explicit.names and f.type == explicit.field(f.name).type):
            return None
        if f.name not in explicit.names:
            if column != f.name or column.lower() in lowered or field_of(column) != f.name:
                return None  # renamed, another case of a column, or a column's other field: value by value
            lowered.add(column.lower())
            if f.type == shapes.UNKNOWN:
                continue  # only nulls: no column yet
            if not shapes.settled(f.type):
                return None
        else:
            column = next(c for c in columns if field_of(c) == f.name)
            if f.type != columns[column] and (column in fixed or shapes.unify(columns[column], f.type) != f.type
                                              or not shapes.settled(f.type)):
                return None
        values = read[f.name].combine_chunks()
        if _outsize(values):
            return None
        out[column] = values
    return out, pa.nulls(rows.num_rows, pa.string()), 0


def _lattice(t: pa.DataType) -> bool:
    """Whether the reader's type is one the rule gives (not a timestamp it guessed from a string, say)."""
    if t in (pa.bool_(), pa.int64(), pa.float64(), pa.string(), shapes.UNKNOWN):
        return True
    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        return (len({n.lower() for n in names}) == len(names) and all(shapes.plain(n) for n in names)
                and all(_lattice(t.field(i).type) for i in range(t.num_fields)))
    if pa.types.is_list(t):
        return _lattice(t.value_type)
    return False


def _outsize(values: pa.Array) -> bool:
    """Whether a double anywhere in `values` is large enough to have been an integer beyond 64 bits."""
    t = values.type
    if pa.types.is_floating(t):
        top = pc.max(pc.abs(values)).as_py()
        return top is not None and top >= _OUTSIZE
    if pa.types.is_struct(t):
        return any(_outsize(values.field(i)) for i in range(t.num_fields))
    if pa.types.is_list(t):
        return _outsize(values.flatten())
    return False


_LONG_DIGITS = re.compile(r"\d{19}")


def _declared_value(value: Any, t: pa.DataType) -> tuple[bool, Any]:
    """(whether `value` goes into a declared column of type `t`, as what): by the rule's conversions where they
    apply, else as Arrow converts it, and only where nothing is lost: a timestamp or a date from a string only (an
    ISO 8601 time without an offset is UTC, as Arrow's JSON reader takes it), an object only if the declared
    struct has each of its fields."""
    if value is None:
        return True, None
    if shapes.places(value, t):
        return True, shapes.convert(value, t)
    if pa.types.is_struct(t):
        fields = {t.field(i).name: t.field(i).type for i in range(t.num_fields)}
        if not isinstance(value, dict) or any(k not in fields for k in value):
            return False, None
        out = {}
        for name, field_type in fields.items():
            placed, out[name] = _declared_value(value.get(name), field_type)
            if not placed:
                return False, None
        return True, out
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        if not isinstance(value, list):
            return False, None
        items = [_declared_value(v, t.value_type) for v in value]
        return (True, [v for _, v in items]) if all(ok for ok, _ in items) else (False, None)
    if pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_time(t):
        return _time_from_text(value, t) if isinstance(value, str) else (False, None)
    if isinstance(value, dict | list):
        return False, None
    try:
        return True, pa.array([value], type=t).to_pylist()[0]
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError, OverflowError):
        return False, None


def _time_from_text(value: str, t: pa.DataType) -> tuple[bool, Any]:
    for route in ([t], [pa.timestamp("us"), t]) if pa.types.is_timestamp(t) and t.tz else ([t],):
        try:
            array: pa.Array = pa.array([value])
            for step in route:
                array = array.cast(step)
            return True, array.to_pylist()[0]
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            continue
    return False, None


def _parse(text: str | None, encoding: str | None) -> tuple[dict[str, Any] | None, Any]:
    """(the payload's object, None), or (None, what `_overflow` keeps of a payload that is no JSON object)."""
    if text is None:
        return {}, None
    if encoding not in (None, "json"):
        return None, {f"${encoding}": text}
    try:
        # orjson reads an integer beyond 64 bits as a float: such a payload is read by json, which keeps it whole.
        value = json.loads(text) if _LONG_DIGITS.search(text) else orjson.loads(text)
    except (orjson.JSONDecodeError, ValueError):
        try:
            value = json.loads(text)  # NaN, Infinity
        except ValueError:
            return None, {"$text": text}
    return (value, None) if isinstance(value, dict) else (None, {"$payload": value})


def _python_path(rows: pa.Table, columns: dict[str, pa.DataType], domain: Domain | None,
                 fixed: dict[str, pa.DataType]) -> tuple[dict[str, Any], pa.Array, int]:
    """The payload columns value by value, by the rule of lake/shapes.py: every value placed or kept in `_overflow`."""
    texts = rows["payload"].to_pylist()
    encodings = rows["payload_encoding"].to_pylist() if "payload_encoding" in rows.column_names else [None] * len(texts)
    objects: list[dict[str, Any] | None] = []
    rest: list[dict[str, Any] | None] = []
    if domain is not None:
        kinds, ids, versions, stream_types = (rows[c].to_pylist() for c in ("event_type", "stream_id", "version",
                                                                             "stream_type"))
        if domain.metadata_field is not None and "metadata" in rows.column_names:
            kinds = [domain.versioned_type(k, _parse(m, "json")[0]) for k, m in zip(kinds, rows["metadata"].to_pylist(),
                                                                                      strict=True)]
    for i, (text, enc) in enumerate(zip(texts, encodings, strict=True)):
        obj, whole = _parse(text, enc)
        if obj is not None and domain is not None:
            obj = domain.upcast(stream_types[i] or "", Event(ids[i], versions[i], kinds[i], obj)).payload
            if not isinstance(obj, dict):
                obj, whole = None, {"$payload": obj}
        objects.append(obj)
        rest.append(whole)
    lowered = {c.lower(): c for c in columns}
    target: dict[str, str | None] = {}  # field → column (None: overflow)
    types: dict[str, Any] = dict(columns)
    for obj in objects:
        for key, value in (obj or {}).items():
            if key not in target:
                column = shapes.column_name(key, _ENVELOPE_NAMES)
                if column is not None and (lowered.setdefault(column.lower(), column) != column
                                           or field_of(column) != key):
                    column = None  # another case of a column's name, or the field `payload_version` beside `version`
                target[key] = column
            column = target[key]
            if column is None or column in fixed:
                continue
            merged = shapes.unify(types.get(column, shapes.UNKNOWN), shapes.infer(value))
            if merged is not None:
                types[column] = merged
    final: dict[str, pa.DataType] = {}
    for c, t in types.items():
        if c in fixed:
            final[c] = t
        elif c in columns:  # a part seen only as null (a nested field) takes `string`; an empty struct none
            final[c] = shapes.pinned(t) if shapes.settled(shapes.pinned(t)) else columns[c]
        elif t != shapes.UNKNOWN and shapes.settled(shapes.pinned(t)):
            final[c] = shapes.pinned(t)
    values: dict[str, list[Any]] = {c: [None] * len(objects) for c in final}
    overflowed = 0
    for i, obj in enumerate(objects):
        spill: dict[str, Any] = {}
        for key, value in (obj or {}).items():
            column = target[key]
            t = final.get(column) if column is not None else None
            if t is not None and column in fixed:
                placed, converted = _declared_value(value, t)
                if placed:
                    values[column][i] = converted  # type: ignore[index]
                    continue
            elif t is not None and shapes.places(value, t):
                values[column][i] = shapes.convert(value, t)  # type: ignore[index]
                continue
            if value is not None:
                spill[key] = value
        if rest[i] is not None:
            spill = {**rest[i], **spill}  # type: ignore[dict-item]
        if spill:
            overflowed += len(spill)
            rest[i] = spill
        else:
            rest[i] = None
    out = {c: pa.array(v, type=final[c]) for c, v in values.items()}
    overflow = pa.array([None if r is None else shapes.json_text(r) for r in rest], pa.string())
    return out, overflow, overflowed
