"""One event type's rows as its typed table holds them: the envelope, `_overflow`, a column per payload field.

The rule (lake/typed/shapes.py) applied to a batch of `events` rows of one type, against the columns its table has:
Arrow's JSON reader where it gives exactly what the rule says (the common case: every payload fits the
columns, or adds plain new ones), value by value in Python for the rest (upcasters, declared payloads, a field
that changed kind, odd names, outsize numbers). What the table does with the result (append, add columns,
rewrite a widened one) is lake/typed/event_tables.py's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
from deltalake import DeltaTable

from es_pipeline.domain import Domain, Event
from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.tables import UTC_MICROS
from es_pipeline.lake.typed import shapes

ENVELOPE = pa.schema([
    ("tenant", pa.string()), ("stream_id", pa.string()), ("stream_type", pa.string()), ("version", pa.int32()),
    ("event_type", pa.string()), ("recorded_at", UTC_MICROS), ("event_date", pa.date32()), ("tx_id", pa.int64()),
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
    return normal_schema_of(pa.schema(table.schema().to_arrow()))


def normal_schema_of(schema: pa.Schema | pa.Table) -> pa.Schema:
    """An Arrow schema (or a table's) as this module compares types."""
    schema = schema.schema if isinstance(schema, pa.Table) else schema
    return pa.schema([pa.field(f.name, _normal(f.type)) for f in schema])


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
    ones); anything it cannot take exactly goes value by value (lake/typed/shapes.py). `domain`: upcast each payload
    first; `declared`: the team's schema of the payloads, whose columns keep their declared types."""
    columns, fixed = payload_columns(held, declared)
    fast = None if domain is not None else arrow_path(rows, columns, fixed)
    payload_cols, overflow, overflowed = fast if fast is not None else python_path(rows, columns, domain, fixed)
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


def by_type(rows: pa.Table, domain: Domain) -> Iterator[tuple[str, pa.Table]]:
    """`rows` (of `events`) grouped by the event type their table is for (the base type, where the domain reads
    versions from the type's suffix), in `events`' order within a group; tenants filled ('' for none)."""
    if rows.num_rows == 0:
        return
    rows = tables.tenant_filled(rows) if "tenant" in rows.column_names else rows
    kinds = rows["event_type"].combine_chunks()
    if domain.schema_version == "suffix":
        kinds = pa.array([domain.base_type(k) for k in kinds.to_pylist()], pa.string())
    encoded = kinds.dictionary_encode()
    order = pc.sort_indices(encoded.indices)
    codes = encoded.indices.take(order)
    sorted_rows = rows.take(order)
    n = len(codes)
    if n == 0:
        return
    bounds = [0, *(pc.indices_nonzero(pc.not_equal(codes.slice(1), codes.slice(0, n - 1))).to_numpy() + 1).tolist(), n]
    names = encoded.dictionary.to_pylist()
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        yield names[codes[lo].as_py()], sorted_rows.slice(lo, hi - lo)


def upcasting(domain: Domain, event_type: str) -> Domain | None:
    """The domain where its upcasters may change this type's payloads, else None (the payloads read as they are)."""
    if domain.schema_version == "suffix" or any(u.event_type == event_type for u in domain.upcasters.values()):
        return domain
    return None


def payload_columns(held: pa.Schema | None,
                    declared: pa.Schema | None) -> tuple[dict[str, pa.DataType], dict[str, pa.DataType]]:
    """(the payload columns a table has, with the declared ones from the start; the declared ones alone)."""
    columns = {} if held is None else {f.name: f.type for f in held if f.name not in ENVELOPE.names}
    fixed: dict[str, pa.DataType] = {}
    for f in declared or ():
        column = shapes.column_name(f.name, _ENVELOPE_NAMES)
        if column is not None:
            fixed[column] = columns.setdefault(column, f.type)
    return columns, fixed


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


def _null_members(values: pa.Array) -> bool:
    """Whether an object of `values` (at any depth) lacks a member, or holds it null, where another has it: Arrow's
    reader orders an object's members by where each first appears, null or not, the rule by where each first
    holds a value (shapes.py `infer`), so their orders could differ: value by value then."""
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        return _null_members(values.flatten())
    if not pa.types.is_struct(values.type):
        return False
    valid = pc.is_valid(values)
    for i in range(values.type.num_fields):
        member = values.field(i)
        if pc.any(pc.and_(valid, pc.is_null(member))).as_py() or _null_members(member):
            return True
    return False


def arrow_path(rows: pa.Table, columns: dict[str, pa.DataType],
                fixed: dict[str, pa.DataType]) -> tuple[dict[str, Any], pa.Array, int] | None:
    """The payload columns by Arrow's JSON reader, or None where it cannot give exactly what the rule says."""
    payload = rows["payload"]
    if "payload_encoding" in rows.column_names and not pc.all(pc.fill_null(pc.equal(
            rows["payload_encoding"], "json"), True)).as_py():
        return None
    if rows.num_rows == 0 or pc.any(pc.is_null(payload)).as_py() or pc.any(pc.match_substring(payload, "\n")).as_py() \
            or pc.any(pc.equal(payload, "null")).as_py():  # a payload `null` is kept as {"$payload": null}
        return None
    texts: dict[str, pa.DataType] = {}  # declared dates and timestamps: read as strings, then cast by the rule
    for c, t in fixed.items():
        if pa.types.is_date32(t) or pa.types.is_timestamp(t):
            texts[c] = t
        elif not _read_as_declared(t):
            return None  # a declared type Arrow's reader converts otherwise than the rule (numbers to dates): by value
    explicit = pa.schema([(field_of(c), pa.string() if c in texts else t) for c, t in columns.items()])
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
    try:
        read.validate(full=True)  # Arrow 26 reads a list whose first items are null ([null, 1]) as invalid arrays
    except pa.ArrowInvalid:
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
            if f.type == shapes.UNKNOWN:
                continue  # only nulls: no column yet
            lowered.add(column.lower())
            if not shapes.settled(f.type):
                return None
        else:
            column = next(c for c in columns if field_of(c) == f.name)
            if f.type != explicit.field(f.name).type and (column in fixed or shapes.unify(columns[column], f.type) != f.type
                                              or not shapes.settled(f.type)):
                return None
        values = read[f.name].combine_chunks()
        if _outsize(values) or _null_members(values):
            return None
        if column in texts:
            values = shapes.cast_texts(values, texts[column])
            if values is None:
                return None
        out[column] = values
    return out, pa.nulls(rows.num_rows, pa.string()), 0


def _read_as_declared(t: pa.DataType) -> bool:
    """Whether Arrow's JSON reader, told a column is of declared type `t`, gives exactly what the rule's
    `declared_value` gives, or fails (then the batch goes value by value): booleans, 64-bit integers, doubles and
    strings take only their own JSON kind in the reader, whole numbers beyond 2**53 aside (`_outsize`)."""
    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        return all(shapes.plain(n) for n in names) and len({n.lower() for n in names}) == len(names) \
            and all(_read_as_declared(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t):
        return _read_as_declared(t.value_type)
    return t in (pa.bool_(), pa.int64(), pa.float64(), pa.string())


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


def python_path(rows: pa.Table, columns: dict[str, pa.DataType], domain: Domain | None,
                 fixed: dict[str, pa.DataType]) -> tuple[dict[str, Any], pa.Array, int]:
    """The payload columns value by value, by the rule of lake/typed/shapes.py: every value placed or kept in `_overflow`."""
    objects, rest = _objects(rows, domain)
    target, types = _column_types(objects, columns, fixed)
    final = {c: t for c, t in types.items() if t != shapes.UNKNOWN}  # a field seen only as nothing: no column yet
    values: dict[str, list[Any]] = {c: [None] * len(objects) for c in final}
    overflowed = 0
    for i, obj in enumerate(objects):
        spill: dict[str, Any] = {}
        for key, value in (obj or {}).items():
            column = target[key]
            t = final.get(column) if column is not None else None
            if t is not None and column in fixed:
                placed, converted = shapes.declared_value(value, t)
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


def _objects(rows: pa.Table, domain: Domain | None) -> tuple[list[dict[str, Any] | None], list[dict[str, Any] | None]]:
    """Each row's payload object (upcast where `domain` is given), and what `_overflow` keeps of one that is none."""
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
    return objects, rest


def _column_types(objects: list[dict[str, Any] | None], columns: dict[str, pa.DataType],
                  fixed: dict[str, pa.DataType],
                  seen: list[tuple[str, pa.DataType]] | None = None) -> tuple[dict[str, str | None], dict[str, Any]]:
    """(each payload field's column, None where it has none; each column's type) over `objects`, the table's
    `columns` first. `seen`: each (column, type) a value brought, in the order they came (`grow` replays them)."""
    lowered = {c.lower(): c for c in columns}  # the names columns take (Delta's names ignore case)
    target: dict[str, str | None] = {}  # field → column (None: overflow)
    types: dict[str, Any] = dict(columns)
    noted: set[tuple[str, Any]] = set()
    candidate: dict[str, str | None] = {}  # field → the column it would take, whatever the claims
    for obj in objects:
        for key, value in (obj or {}).items():
            if key not in target:
                column = shapes.column_name(key, _ENVELOPE_NAMES)
                target[key] = None if column is None or field_of(column) != key else column  # `payload_version`
                candidate[key] = target[key]
            column = target[key]
            if candidate[key] is None or candidate[key] in fixed:
                continue
            t = shapes.infer(value)
            if seen is not None and t is not shapes.MISFIT and t != shapes.UNKNOWN \
                    and (candidate[key], t) not in noted:  # every kind: another batch's columns may take it
                noted.add((candidate[key], t))  # type: ignore[arg-type]
                seen.append((candidate[key], t))  # type: ignore[arg-type]
            if column is None:
                continue
            if column not in types:
                if t in (shapes.UNKNOWN, shapes.MISFIT):
                    continue  # no type yet: the name is taken by the first field of it that brings one
                if lowered.setdefault(column.lower(), column) != column:
                    target[key] = None  # another case of a column's name
                    continue
            merged = shapes.unify(types.get(column, shapes.UNKNOWN), t)
            if merged is not None:
                types[column] = merged
    return target, types


def column_types(rows: pa.Table, *, domain: Domain | None = None,
                 declared: pa.Schema | None = None) -> list[tuple[str, pa.DataType]]:
    """The (column, type) pairs `rows` (of one type) bring, in the order they came: what `grow` needs to give, from
    several batches' pairs in the lake's order, the columns one batch of them all would (a build split across a
    cluster's executors, lake/typed/event_tables.py)."""
    columns, fixed = payload_columns(None, declared)
    fast = None if domain is not None else arrow_path(rows, columns, fixed)
    found = [] if fast is None else [(c, v.type) for c, v in fast[0].items() if c not in fixed]
    if fast is not None and not any(_has_struct(t) for _, t in found):
        return found  # one kind per column, whose values all meet: the column's type stands for them all
    # Objects: the batch's type first (its fields in the order they came), then each value's, where one of their
    # fields meets another batch's column when the whole object cannot (another case of a field's name).
    seen: list[tuple[str, pa.DataType]] = list(found)
    _column_types(_objects(rows, domain)[0], columns, fixed, seen)
    return seen


def _has_struct(t: pa.DataType) -> bool:
    return pa.types.is_struct(t) or (pa.types.is_list(t) and _has_struct(t.value_type))


def grow(columns: dict[str, pa.DataType], pairs: Iterable[tuple[str, pa.DataType]],
         fixed: dict[str, pa.DataType]) -> None:
    """`columns` widened and extended, in place, by the (column, type) pairs of a later batch (`column_types`), as
    the value-by-value path grows them: a new column unless another case of its name holds one; a type that cannot
    meet the column's leaves it as it is (its values go to `_overflow`)."""
    lowered = {c.lower(): c for c in columns}
    for column, t in pairs:
        if column in fixed:
            continue
        if column not in columns:
            if lowered.setdefault(column.lower(), column) == column:
                columns[column] = t
            continue
        merged = shapes.unify(columns[column], t)
        if merged is not None:
            columns[column] = merged


def to_place_again(typed: Typed, overflow: Callable[[], pa.Array | pa.ChunkedArray]) -> dict[str, pa.DataType]:
    """The columns whose earlier rows a table must place again (`regrown`) before it takes `typed`: every widened
    one, and every new one where the table's `_overflow` (read by `overflow()`, only then) holds a value for its
    field (the new column may take it). Empty: the rows are appended, new columns null in earlier rows."""
    new = {c: typed.rows.schema.field(c).type for c in typed.added}
    changed = {c: typed.rows.schema.field(c).type for c in typed.widened}
    if new:
        wanted = {field_of(c) for c in new}
        if any(wanted.intersection(json.loads(text)) for text in pc.drop_null(overflow()).to_pylist()):
            changed.update(new)
    return changed


def regrown(before: pa.Table, schema: pa.Schema, changed: dict[str, pa.DataType]) -> pa.Table:
    """A table's earlier rows under its new `schema`, after a batch added or widened the columns `changed`: each
    such column's values placed again by the rule for its new type (a whole number a new double would round goes
    to `_overflow`), and each value `_overflow` kept for its field tried again (a column that came, or widened,
    may take it now). The rows then hold what a rebuild of the table would: the rule gives the same table
    whatever the batches were."""
    n = before.num_rows
    texts = before[shapes.OVERFLOW].to_pylist() if shapes.OVERFLOW in before.column_names else [None] * n
    spills: dict[int, dict[str, Any]] = {i: json.loads(t) for i, t in enumerate(texts) if t is not None}
    touched: set[int] = set()
    placed: dict[str, pa.Array] = {}
    for column, t in changed.items():
        name = field_of(column)
        kept = [i for i, spill in spills.items() if name in spill]
        held = before[column].combine_chunks() if column in before.column_names else None
        fast = None if held is None or kept else _cast_exactly(held, t)
        if fast is not None:
            placed[column] = fast
            continue
        values = held.to_pylist() if held is not None else [None] * n
        for i, value in enumerate(values):
            if value is not None and not shapes.places(value, t):
                spills.setdefault(i, {})[name] = value
                values[i] = None
                touched.add(i)
        for i in kept:
            if values[i] is None and shapes.places(spills[i][name], t):
                values[i] = spills[i].pop(name)
                touched.add(i)
        placed[column] = pa.array([shapes.convert(v, t) for v in values], type=t)
    for i in touched:
        texts[i] = shapes.json_text(spills[i]) if spills.get(i) else None
    out = []
    for f in schema:
        if f.name == shapes.OVERFLOW:
            out.append(pa.array(texts, pa.string()))
        elif f.name in placed:
            out.append(placed[f.name])
        elif f.name in before.column_names:
            out.append(before[f.name].cast(f.type))
        else:
            out.append(pa.nulls(n, f.type))
    return pa.table(out, schema=schema)


def _cast_exactly(values: pa.Array, to: pa.DataType) -> pa.Array | None:
    """`values` as type `to` by Arrow's cast where it gives what the rule does (an integer or boolean as its JSON
    text, an integer up to 2**53 as a double), else None."""
    held = values.type
    if held == to:
        return values
    if pa.types.is_string(to) and (pa.types.is_integer(held) or pa.types.is_boolean(held)):
        return values.cast(to)
    if pa.types.is_floating(to) and pa.types.is_integer(held):
        low, high = pc.min(values).as_py(), pc.max(values).as_py()
        return values.cast(to) if low is None or (-shapes.EXACT <= low and high <= shapes.EXACT) else None
    return None
