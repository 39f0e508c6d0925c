"""Declared folds: a stream's state as aggregations over its events, which the engines run natively.

Much of what teams fold is arithmetic: a balance is a signed sum, a status is the last of some event types, an owner is
a field of the first event, a count is a count. Declared so, a state needs no Python call per event: a whole build is
one aggregation per stream type over the events (DuckDB in process, Spark past the engine rule's bound:
lake/state/declared_build.py), and the same declaration also folds one event at a time (`Declared.fold`), exactly as
the aggregation does, for increments, quarantine and every path a Python reducer takes.

    from es_pipeline.declared import count, first, last_of, total

    domain.declare("account", revision=1, fields={
        "owner": first("owner", of=["Opened"]),
        "status": last_of({"Opened": "open", "Closed": "closed"}),      # a constant set by an event type
        "balance": total("amount", add=["Deposited"], subtract=["Withdrawn"], scale=2),
        "deposits": count(of=["Deposited"]),
    })

Per field, one aggregation over the stream's events in version order, each optionally only over some event types:

- `last(field, of=)` / `first(field, of=)`: the payload field's value at the stream's highest (lowest) version among
  those events where it is present and not null;
- `total(field, add=, subtract=, scale=)`: an exact decimal sum (`scale` places, half away from zero), the amounts of
  `subtract` taken away; kept as a decimal string in the JSON state (exact), a decimal column in a typed table;
- `count(of=)`: how many such events; `minimum(field, of=)` / `maximum(field, of=)`: a number's least or greatest;
- `last_of({event type: value})`: the constant of the last such event (a status set by event types).

A count is 0 and a total "0" before any such event; the others are absent (null). An event type no field names
leaves the state as it is (its version counts). Refused at declaration, in one line, when it cannot be said this way:
then the team writes the reducer in Python (docs/domain.md, "Declared folds").
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any

from es_pipeline.errors import DomainError

KINDS = ("last", "first", "total", "count", "minimum", "maximum", "last_of")
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_SCALE = 18


@dataclass(frozen=True)
class Agg:
    """One field's aggregation (build it with `last`, `first`, `total`, `count`, `minimum`, `maximum`, `last_of`)."""

    kind: str
    source: str | None = None  # the payload field read (None: `count`, `last_of`)
    of: tuple[str, ...] | None = None  # the event types it reads (None: every type)
    subtract: tuple[str, ...] = ()  # `total`: the types whose amounts are taken away
    scale: int = 0  # `total`: decimal places
    values: tuple[tuple[str, Any], ...] = ()  # `last_of`: (event type, constant)

    def types(self) -> tuple[str, ...] | None:
        """Every event type this aggregation reads (None: all)."""
        if self.kind == "last_of":
            return tuple(t for t, _ in self.values)
        if self.kind == "total" and self.of is not None:
            return (*self.of, *self.subtract)
        return self.of

    def reads(self, event_type: str) -> bool:
        types = self.types()
        return types is None or event_type in types

    def constant(self, event_type: str) -> Any:
        """`last_of`: the value `event_type` sets."""
        for t, value in self.values:
            if t == event_type:
                return value
        raise KeyError(event_type)


def _types(of: Iterable[str] | str | None, what: str) -> tuple[str, ...] | None:
    if of is None:
        return None
    if isinstance(of, str):
        of = [of]
    types = tuple(of)
    if not types or not all(isinstance(t, str) and t for t in types):
        raise DomainError(f"{what}: `of` is {of!r}", "Name the event types as a list of strings, or leave `of` out "
                          "(every type).")
    return types


def _source(name: Any, what: str) -> str:
    if not isinstance(name, str) or not _FIELD.fullmatch(name):
        raise DomainError(f"{what} reads payload field {name!r}",
                          "Name a top-level payload field (letters, digits, underscores); a nested or computed value "
                          "needs a Python reducer.")
    return name


def last(source: str, *, of: Iterable[str] | str | None = None) -> Agg:
    return Agg("last", _source(source, "last()"), _types(of, "last()"))


def first(source: str, *, of: Iterable[str] | str | None = None) -> Agg:
    return Agg("first", _source(source, "first()"), _types(of, "first()"))


def minimum(source: str, *, of: Iterable[str] | str | None = None) -> Agg:
    return Agg("minimum", _source(source, "minimum()"), _types(of, "minimum()"))


def maximum(source: str, *, of: Iterable[str] | str | None = None) -> Agg:
    return Agg("maximum", _source(source, "maximum()"), _types(of, "maximum()"))


def count(*, of: Iterable[str] | str | None = None) -> Agg:
    return Agg("count", None, _types(of, "count()"))


def total(source: str, *, add: Iterable[str] | str | None = None, subtract: Iterable[str] | str = (),
          scale: int = 2) -> Agg:
    if not isinstance(scale, int) or isinstance(scale, bool) or not 0 <= scale <= MAX_SCALE:
        raise DomainError(f"total({source!r}) has scale {scale!r}", f"Give a whole number of decimal places from 0 to "
                          f"{MAX_SCALE}.")
    taken = _types(subtract, "total(subtract=)") if subtract else ()
    added = _types(add, "total(add=)")
    if added is None and taken:
        raise DomainError(f"total({source!r}) subtracts {', '.join(taken)} but adds every event type",
                          "Name the types it adds (`add=[...]`) beside those it subtracts.")
    both = set(added or ()) & set(taken or ())
    if both:
        raise DomainError(f"total({source!r}) both adds and subtracts {', '.join(sorted(both))}",
                          "Name each event type once.")
    return Agg("total", _source(source, "total()"), added, tuple(taken or ()), scale)


def last_of(values: Mapping[str, Any]) -> Agg:
    if not isinstance(values, Mapping) or not values:
        raise DomainError(f"last_of() is given {values!r}", "Give a mapping of event type to the value it sets, e.g. "
                          "{'Opened': 'open', 'Closed': 'closed'}.")
    for event_type, value in values.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise DomainError(f"last_of(): the value of {event_type!r} is {value!r}, which JSON cannot hold",
                              "Use a string, number, bool or null.") from None
        if isinstance(value, (dict, list)):
            raise DomainError(f"last_of(): the value of {event_type!r} is a {type(value).__name__}",
                              "Use a string, number, bool or null.")
    return Agg("last_of", None, None, values=tuple(values.items()))


@dataclass(frozen=True)
class Declared:
    """A stream type's state as named aggregations (`fields`), in the order declared."""

    fields: tuple[tuple[str, Agg], ...]
    read_types: tuple[str, ...] | None = field(default=None)  # every type any field reads (None: all)
    # The totals a typed state declares as decimals: held as `Decimal` in the fold (its typed table's column), not as
    # their digits.
    decimals: tuple[str, ...] = ()

    @classmethod
    def of(cls, fields: Mapping[str, Agg], what: str) -> Declared:
        if not isinstance(fields, Mapping) or not fields:
            raise DomainError(f"{what} declares no field", "Give `fields` as a mapping of name to aggregation, e.g. "
                              "{'deposits': count(of=['Deposited'])}.")
        for name, agg in fields.items():
            if not isinstance(name, str) or not _FIELD.fullmatch(name):
                raise DomainError(f"{what} has a field named {name!r}", "Name each field with letters, digits and "
                                  "underscores.")
            if not isinstance(agg, Agg):
                raise DomainError(f"{what}, field {name!r}, is {agg!r}",
                                  f"Declare it with one of {', '.join(KINDS)} (es_pipeline.declared); anything else "
                                  "needs a Python reducer.")
        types: set[str] | None = set()
        for agg in fields.values():
            read = agg.types()
            if read is None or types is None:
                types = None
            else:
                types |= set(read)
        return cls(tuple(fields.items()), None if types is None else tuple(sorted(types)))

    def initial(self) -> dict[str, Any]:
        """The state before any event the fields read: counts 0, totals "0" at their scale; the rest absent."""
        state: dict[str, Any] = {}
        for name, agg in self.fields:
            if agg.kind == "count":
                state[name] = 0
            elif agg.kind == "total":
                zero = Decimal(0).quantize(_quantum(agg.scale))
                state[name] = zero if name in self.decimals else format(zero, "f")
        return state

    def __post_init__(self) -> None:
        # What the fold works out once, not per event: the initial state, and per event type the fields that read it.
        object.__setattr__(self, "_start", self.initial())  # a frozen dataclass: set past __setattr__
        object.__setattr__(self, "_by_type", {})

    def reading(self, event_type: str) -> tuple[tuple[str, Agg], ...]:
        """The fields that read events of `event_type`, in the order declared (worked out once per type)."""
        by_type: dict[str, tuple[tuple[str, Agg], ...]] = self.__dict__["_by_type"]
        found = by_type.get(event_type)
        if found is None:
            found = by_type[event_type] = tuple((n, a) for n, a in self.fields if a.reads(event_type))
        return found

    def fold(self, state: dict[str, Any], event: Any) -> dict[str, Any]:
        """One event onto `state` (a Python fold, as a reducer is): what the aggregation over the events up to this
        one gives. `event` is an `es_pipeline.domain.Event`."""
        reading = self.reading(event.event_type)
        out = {**self.__dict__["_start"], **state}
        payload = event.payload if isinstance(event.payload, dict) else {}
        for name, agg in reading:
            if agg.kind == "count":
                out[name] = int(out[name]) + 1
            elif agg.kind == "last_of":
                out[name] = agg.constant(event.event_type)
            else:
                value = payload.get(agg.source) if agg.source else None
                if value is None:
                    continue
                if agg.kind == "last":
                    out[name] = value
                elif agg.kind == "first":
                    out.setdefault(name, value)
                elif agg.kind == "total":
                    amount = decimal_of(value, agg.scale, name)
                    if event.event_type in agg.subtract:
                        amount = -amount
                    summed = (Decimal(out[name]) + amount).quantize(_quantum(agg.scale))
                    out[name] = summed if name in self.decimals else format(summed, "f")  # "0.00000000", not "0E-8"
                elif agg.kind in ("minimum", "maximum"):
                    number = _number(value, name)
                    held = out.get(name)
                    if held is None or (number < held if agg.kind == "minimum" else number > held):
                        out[name] = number
        return out

    def __call__(self, state: dict[str, Any], event: Any) -> dict[str, Any]:
        return self.fold(state, event)


def _quantum(scale: int) -> Decimal:
    return Decimal(1).scaleb(-scale)


def decimal_of(value: Any, scale: int, name: str) -> Decimal:
    """A payload's amount as an exact decimal at `scale` places (half away from zero), as DuckDB and Spark cast it."""
    if isinstance(value, bool):
        raise ValueError(f"field {name!r}: {value!r} is not an amount")
    try:
        return Decimal(str(value)).quantize(_quantum(scale), rounding=ROUND_HALF_UP)
    except (InvalidOperation, ValueError):
        raise ValueError(f"field {name!r}: {value!r} is not an amount") from None


def _number(value: Any, name: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"field {name!r}: {value!r} is not a number")
    return value


def refuse_upcast(declared: Declared, stream_type: str, upcast_types: Sequence[str], what: str) -> None:
    """A declared fold reads stored payloads: refused where an upcaster rewrites an event type it reads."""
    read = declared.read_types
    hit = sorted(upcast_types if read is None else set(read) & set(upcast_types))
    if hit:
        raise DomainError(f"{what} reads {', '.join(hit)}, which an upcaster rewrites",
                          "A declared fold reads the payloads as stored: write this stream type's reducer in Python "
                          "(the upcaster then applies), or drop the upcaster.")
