"""A team's domain, in the team's own package: the reducers that fold its streams into `stream_state`.

es_pipeline holds no domain of its own. A team writes one in its package, built from this module alone:

    # shop/domain.py
    from es_pipeline.domain import Domain, Event, State, UnknownEventType

    domain = Domain("shop")

    @domain.reducer("order", revision=1)
    def order(state: State, event: Event) -> State:
        if event.event_type == "OrderPlaced":
            return {**state, "status": "placed", "total": event.payload["total"]}
        raise UnknownEventType(event)

and names the module in `ES_PIPELINE_DOMAIN=shop.domain` (several, comma-separated: one domain per package,
merged; two that fold the same stream type are refused). docs/domain.md walks through it.

A reducer's `revision`: bump it when its logic changes, and `stream_state` rebuilds that stream type (alone)
from `events`, and new snapshots are taken. A stream type with no reducer is no error: its streams get their
row (version, times, type) with no state, and a reducer added later folds them from their first event (its
revision differs from the row's 0).

Policy for an event type a reducer does not know: the fold fails there, naming stream, version and type
(`UnknownEventType`); with `skip_unknown=True` the event is skipped and counted instead. A reducer that
raises, or a payload missing a field (`KeyError`), fails the fold there too, naming the stream, version and
field. What a failure does is the domain's `fold_errors` (ES_PIPELINE_FOLD_ERRORS, docs/decisions/0051):
`quarantine` (the default) holds that stream at its last good state, marked `quarantined`, and every other
stream goes on; `stop` fails the run, and nothing of it is committed.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import importlib
import re
import types
import typing
import zoneinfo
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import pyarrow as pa

from es_pipeline.declared import Agg, Declared, refuse_upcast
from es_pipeline.errors import DomainError

State = dict[str, Any]
FOLD_ERRORS = ("quarantine", "stop")  # what a reducer's failure does (`Domain.fold_errors`)


class Event(NamedTuple):
    """One event as a reducer sees it (a named tuple: made once per event folded, so it must be cheap)."""

    stream_id: str
    version: int
    event_type: str
    payload: dict[str, Any]


class UnknownEventType(Exception):
    """Raised by a reducer for an event type it has no case for (the policy: the module docstring)."""

    def __init__(self, event: Event) -> None:
        self.event = event
        super().__init__(f"no reducer case for event type {event.event_type!r}")


Fold = Callable[[State, Event], State]


@dataclass(frozen=True)
class Reducer:
    stream_type: str
    revision: int
    fold: Fold
    domain: str = ""  # the name of the domain that registered it (for messages)
    state: pa.Schema | None = None  # its state's fields, declared: the stream type then has a typed table too
    history: str | None = None  # "each" or "daily:<zone>": the stream type keeps stream_state_<type>_history too
    # A declared fold (es_pipeline/declared.py; `fold` is then the `Declared` itself): whole builds run it natively.
    declared: Declared | None = None


Upcast = Callable[[dict[str, Any]], dict[str, Any]]
VERSION_SOURCES = ("none", "suffix", "field:<name>", "metadata:<name>")


@dataclass(frozen=True)
class Upcaster:
    """Turns a payload of `event_type` at schema `version` into the next version's shape."""

    event_type: str
    version: int
    upcast: Upcast
    stream_types: tuple[str, ...] | None = None  # the stream types whose events it applies to (None: all)

    def applies_to(self, stream_type: str) -> bool:
        return self.stream_types is None or stream_type in self.stream_types


def history_grain(history: bool | str | None, what: str) -> str | None:
    """A reducer's `history=` as the lake keeps it: None (no history), "each", or "daily:<IANA zone>"."""
    if history is None or history is False:
        return None
    if history is True or history == "each":
        return "each"
    if isinstance(history, str) and (history == "daily" or history.startswith("daily:")):
        zone = history.partition(":")[2] or "UTC"
        try:
            zoneinfo.ZoneInfo(zone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise DomainError(f"{what} keeps its history in days of zone {zone!r}, which is no time zone here",
                              'Name an IANA zone, as in history="daily:Europe/Paris" (history="daily": UTC days).') \
                from None
        return f"daily:{zone}"
    raise DomainError(f"{what} has history={history!r}",
                      'Say history=True (every state), history="daily" (the state at the end of each UTC day it '
                      'changed) or history="daily:<zone>"; leave it out for no history.')


KeyOf = Callable[["Event"], Any]
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
# The names of the tables es_pipeline keeps in the lake (lake/), in one place: a projection's table (named as the
# projection) may take none of them, nor begin with a typed table's prefix.
TABLES = ("events", "stream_state", "stream_catalog", "event_type_daily", "snapshots")
EVENT_TABLES = "event_tables"  # the typed event tables' mapping
STATE_TABLE_PREFIX = "stream_state_"  # a typed state table: stream_state_<stream type>
EVENT_TABLE_PREFIX = "events_"  # a typed event table: events_<event type>
RESERVED = (*TABLES, EVENT_TABLES)
RESERVED_PREFIXES = (STATE_TABLE_PREFIX, EVENT_TABLE_PREFIX)



@dataclass(frozen=True)
class Projection:
    """A cross-stream projection: events of `event_types` from any stream, grouped by a key read from each
    payload, each key's events folded by `fold` in the lake's order (docs/domain.md, "Cross-stream
    projections"). Its table is `name`: one row per (tenant, key)."""

    name: str
    event_types: tuple[str, ...]
    key: str | KeyOf  # a payload field's name, or a function of the event (None: the event has no key)
    key_column: str  # the key's column in the table
    revision: int
    fold: Fold
    domain: str = ""
    state: pa.Schema | None = None  # declared: one column per field beside the JSON state

    def key_of(self, event: Event) -> Any:
        if callable(self.key):
            return self.key(event)
        return event.payload.get(self.key) if isinstance(event.payload, dict) else None

    @property
    def definition(self) -> str:
        """What the table's rows depend on besides the fold's code: a change of it rebuilds the table."""
        key = self.key if isinstance(self.key, str) else f"{getattr(self.key, '__module__', '?')}." \
            f"{getattr(self.key, '__qualname__', '?')}"
        return f"types={','.join(sorted(self.event_types))};key={key};column={self.key_column};revision={self.revision}"


class Domain:
    """What a team registers: reducers by stream type, upcasters by event type and version. Made once per
    package, at import.

    `schema_version`: where an event's schema version is read, for the upcasters: `"none"` (every event is at
    version 1: an upcaster then takes payloads of any shape and returns the current one), `"suffix"` (the
    event type's `.vN` or `_vN` ending: `ItemAdded.v2` is `ItemAdded` at version 2, `ItemAdded` alone version
    1; reducers see the type without it), `"field:<name>"` (a payload field, e.g. `field:schema_version`;
    absent: version 1), or `"metadata:<name>"` (a field of the event's metadata, e.g. `metadata:schema_version`;
    absent: version 1; the lake reads `metadata` for the folds only then).

    `fold_errors`: what a reducer's failure does (`FOLD_ERRORS`): `"quarantine"` holds that stream (or a
    cross-stream projection's key) at its last good state and goes on with the others; `"stop"` fails the update.
    The setting ES_PIPELINE_FOLD_ERRORS gives it to the loaded domain (`folding`)."""

    def __init__(self, name: str, *, schema_version: str = "none", fold_errors: str = "quarantine") -> None:
        self.name = name
        if fold_errors not in FOLD_ERRORS:
            raise DomainError(f"domain {name!r} says fold_errors={fold_errors!r}",
                              f"Say one of {', '.join(FOLD_ERRORS)}.")
        self.fold_errors = fold_errors
        self.reducers: dict[str, Reducer] = {}
        self.upcasters: dict[tuple[str, int], Upcaster] = {}
        self.projections: dict[str, Projection] = {}
        self.event_schemas: dict[str, pa.Schema] = {}  # declared payloads: their typed event tables' columns
        if schema_version not in ("none", "suffix") and not any(
                schema_version.startswith(p) and len(schema_version) > len(p) for p in ("field:", "metadata:")):
            raise DomainError(f"domain {name!r} reads schema versions from {schema_version!r}",
                              f"Say one of {', '.join(VERSION_SOURCES)}.")
        self.schema_version = schema_version
        self._folds: dict[str, Reducer] | None = None
        self._chains: dict[str, _Upcasting] = {}

    def __repr__(self) -> str:
        return f"Domain({self.name!r}: {', '.join(sorted(self.reducers)) or 'no reducers'})"

    @property
    def quarantines(self) -> bool:
        """A reducer's failure holds its stream (or key) alone (`fold_errors="quarantine"`), not the update."""
        return self.fold_errors == "quarantine"

    def folding(self, fold_errors: str) -> Domain:
        """This domain with `fold_errors` as the setting says (a copy; the same object where it says so already):
        the reducers, upcasters and projections shared."""
        if fold_errors == self.fold_errors:
            return self
        if fold_errors not in FOLD_ERRORS:
            raise DomainError(f"fold_errors={fold_errors!r}", f"Say one of {', '.join(FOLD_ERRORS)}.")
        out = copy.copy(self)
        out.fold_errors = fold_errors
        return out

    def reducer(
        self, stream_type: str, *, revision: int, state: Any = None, history: bool | str = False
    ) -> Callable[[Fold], Fold]:
        """Register the decorated function as the reducer of `stream_type` (see the module docstring).

        `state`: what its state holds, as a dataclass, a TypedDict or an Arrow schema: the stream type then
        gets a typed table too, one column per field (docs/domain.md, "Typed state").
        `history`: True (or "each") keeps every state each stream has been in, "daily" the state at the end of
        each day it changed (UTC days; "daily:Europe/Paris" for another zone), in `stream_state_<type>_history`
        (docs/domain.md, "State history")."""
        if not isinstance(revision, int) or isinstance(revision, bool) or not 0 < revision < 1000:
            raise DomainError(f"the reducer of {stream_type!r} in domain {self.name!r} has revision {revision!r}",
                              "A revision is a whole number from 1 to 999: start at 1, add one when its logic changes.")

        schema = None if state is None else state_schema(state, f"the state of {stream_type!r} in domain {self.name!r}")
        grain = history_grain(history, f"the reducer of {stream_type!r} in domain {self.name!r}")

        def register(fn: Fold) -> Fold:
            self.add(Reducer(stream_type, revision, fn, self.name, schema, grain))
            return fn

        return register

    def declare(
        self, stream_type: str, *, revision: int, fields: Mapping[str, Agg], state: Any = None,
        history: bool | str = False,
    ) -> Declared:
        """Declare the reducer of `stream_type` as aggregations over its events (es_pipeline/declared.py): whole
        builds run natively, with no Python call per event; every other path folds it as a Python reducer. `state`
        and `history` as for `reducer` (a type that keeps history is built by the Python fold: its trail is made
        event by event). Refused in one line where a field cannot be declared so."""
        what = f"the declared reducer of {stream_type!r} in domain {self.name!r}"
        declared = Declared.of(fields, what)
        schema = None if state is None else state_schema(state, f"the state of {stream_type!r} in domain {self.name!r}")
        decimals = tuple(name for name, agg in declared.fields if agg.kind == "total" and schema is not None
                         and schema.get_field_index(name) >= 0 and pa.types.is_decimal(schema.field(name).type))
        declared = dataclasses.replace(declared, decimals=decimals)
        self.reducer(stream_type, revision=revision, state=state, history=history)(declared)
        held = self.reducers[stream_type]
        self.reducers[stream_type] = dataclasses.replace(held, declared=declared)
        self._folds = None
        return declared

    def add(self, reducer: Reducer) -> None:
        held = self.reducers.get(reducer.stream_type)
        if held is not None and held.fold is not reducer.fold:
            raise DomainError(
                f"two reducers fold stream type {reducer.stream_type!r}: {_name(held)} (domain {held.domain!r}) "
                f"and {_name(reducer)} (domain {reducer.domain!r})",
                "A stream type has one reducer: remove one, or name one of the modules in ES_PIPELINE_DOMAIN only.")
        self.reducers[reducer.stream_type] = reducer
        self._folds = None

    def upcaster(
        self, event_type: str, *, version: int, stream_types: Sequence[str] | None = None
    ) -> Callable[[Upcast], Upcast]:
        """Register the decorated function as the upcaster of `event_type` payloads at schema `version` to
        version + 1; chains (1 → 2 → 3) compose. Registering, changing or removing one is a revision change of
        the reducers it applies to (`stream_types`, or all): their stream types are rebuilt."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise DomainError(f"the upcaster of {event_type!r} in domain {self.name!r} is for version {version!r}",
                              "A schema version is a whole number from 1: the version the payloads it takes have.")

        def register(fn: Upcast) -> Upcast:
            self.add_upcaster(Upcaster(event_type, version, fn, None if stream_types is None else tuple(stream_types)))
            return fn

        return register

    def add_upcaster(self, upcaster: Upcaster) -> None:
        key = (upcaster.event_type, upcaster.version)
        held = self.upcasters.get(key)
        if held is not None and held.upcast is not upcaster.upcast:
            raise DomainError(f"two upcasters take {upcaster.event_type!r} at version {upcaster.version}",
                              "An event type's version has one upcaster: remove one.")
        self.upcasters[key] = upcaster
        self._folds = None
        self._chains = {}

    def projection(
        self, name: str, *, events: Sequence[str], key: str | KeyOf, revision: int, state: Any = None,
        key_column: str | None = None,
    ) -> Callable[[Fold], Fold]:
        """Register the decorated function as the fold of the cross-stream projection `name`: every event of a
        type in `events`, from any stream, upcast first, grouped by `key` (a payload field's name, or a function
        of the event returning the key or None), folded per key in the lake's order (docs/domain.md). Its table
        is `name`, one row per (tenant, key): the key in `key_column` (default: the field's name, else `key`),
        the state as JSON, and with `state` (a dataclass, TypedDict or Arrow schema) one column per field."""
        what = f"projection {name!r} in domain {self.name!r}"
        if not isinstance(name, str) or not _NAME.match(name) or name in RESERVED or name.startswith(RESERVED_PREFIXES):
            raise DomainError(f"{what}: its name is its table's, and {name!r} cannot be one",
                              "Name it in lower case letters, digits and _ (a letter first), other than "
                              f"{', '.join(RESERVED)}, stream_state_… and events_…")
        if isinstance(events, str) or not events or not all(isinstance(e, str) and e for e in events):
            raise DomainError(f"{what} folds events={events!r}", "Give a list of event type names, e.g. "
                              "events=[\"OrderPlaced\", \"OrderShipped\"].")
        if not (callable(key) or (isinstance(key, str) and key)):
            raise DomainError(f"{what} has key {key!r}", "Give a payload field's name, or a function of the event.")
        column = key_column or (key if isinstance(key, str) else "key")
        if not _NAME.match(column) or column in PROJECTION_ENVELOPE:
            raise DomainError(f"{what}: its key column would be {column!r}",
                              f"Say key_column= a name in lower case other than {', '.join(PROJECTION_ENVELOPE)}.")
        if not isinstance(revision, int) or isinstance(revision, bool) or not 0 < revision < 1000:
            raise DomainError(f"{what} has revision {revision!r}",
                              "A revision is a whole number from 1 to 999: start at 1, add one when its logic changes.")
        schema = None if state is None else state_schema(state, f"the state of {what}", PROJECTION_ENVELOPE)
        if schema is not None and column in schema.names:
            raise DomainError(f"{what}: its state has a field {column!r}, the key column's name",
                              "Rename the field, or say key_column=.")

        def register(fn: Fold) -> Fold:
            self.add_projection(Projection(name, tuple(events), key, column, revision, fn, self.name, schema))
            return fn

        return register

    def event_schema(self, event_type: str, schema: Any) -> None:
        """Declare what payloads of `event_type` hold (a dataclass, a TypedDict or an Arrow schema, in today's shape:
        after the upcasters): its typed event table (`events_<type>`) has these columns with these types from the
        first, instead of what the payloads suggest, and never widens them; a value that does not convert to its
        declared type is kept in `_overflow` (docs/analysts.md). Other fields still get columns by the rule."""
        if not isinstance(event_type, str) or not event_type:
            raise DomainError(f"domain {self.name!r} declares a payload schema for event type {event_type!r}",
                              "Name the event type as the store spells it (the base type, where versions are suffixes).")
        declared = state_schema(schema, f"the payload of {event_type!r} in domain {self.name!r}", ())
        held = self.event_schemas.get(event_type)
        if held is not None and not held.equals(declared):
            raise DomainError(f"event type {event_type!r} has two payload schemas", "Declare it once.")
        self.event_schemas[event_type] = declared

    def add_projection(self, projection: Projection) -> None:
        held = self.projections.get(projection.name)
        if held is not None and held.fold is not projection.fold:
            raise DomainError(f"two projections are named {projection.name!r} (domains {held.domain!r} and "
                              f"{projection.domain!r})", "A projection's name is its table's: rename one.")
        self.projections[projection.name] = projection

    def upcast(self, stream_type: str, event: Event) -> Event:
        """`event` (of a stream of `stream_type`) as the folds see it: its type without a version suffix, its
        payload brought to the current shape by the upcasters that apply (what `folds` does before a reducer)."""
        chains = self._chains.get(stream_type)
        if chains is None:
            chains = self._chains[stream_type] = _Upcasting(_identity, self._chains_of(stream_type), self._version_source)
        return chains.upcast(event)

    def base_type(self, event_type: str) -> str:
        """An event type as stored, as the folds see it: without its version suffix where versions are read from
        there (with `metadata:<name>`, a stored type has none: the suffix is added when read)."""
        if self.schema_version == "suffix":
            m = _SUFFIX.match(event_type)
            if m is not None:
                return m.group("base")
        return event_type

    def revisions(self) -> dict[str, int]:
        """Each stream type's revision as `stream_state` records it: its reducer's, plus one per upcaster
        that applies to it (so that registering one rebuilds what it changes)."""
        return {t: r.revision for t, r in self.folds.items()}

    @property
    def metadata_field(self) -> str | None:
        """The metadata field schema versions are read from (`metadata:<name>`), or None."""
        return self.schema_version[len("metadata:"):] if self.schema_version.startswith("metadata:") else None

    def versioned_type(self, event_type: str, metadata: Any) -> str:
        """With `metadata:<name>`: the event type with its version as a suffix (`ItemAdded.v2`), as the folds read it
        (lake/state/fold.py `with_schema_versions`); the suffix is stripped before any reducer sees the type."""
        field = self.metadata_field
        if field is None:
            return event_type
        held = metadata.get(field) if isinstance(metadata, dict) else None
        # A whole number from 1, as a JSON number or digits in a string; anything else is version 1 (Spark's
        # path in lake/state/stream_state.py reads it by the same rule).
        text = str(held) if isinstance(held, int) and not isinstance(held, bool) else held
        version = int(text) if isinstance(text, str) and text.isascii() and text.isdecimal() and len(text) <= 18 else 1
        return f"{event_type}.v{max(version, 1)}"

    @property
    def rewrites_events(self) -> bool:
        """Whether `upcast` may change an event: upcasters registered, or versions read as a type's suffix."""
        return bool(self.upcasters) or self._version_source == "suffix"

    @property
    def _version_source(self) -> str:
        """Where `_Upcasting` reads a version: a metadata version travels as the type's suffix (`versioned_type`)."""
        return "suffix" if self.metadata_field is not None else self.schema_version

    @property
    def folds(self) -> dict[str, Reducer]:
        """The reducers as the lake folds with them: each behind its stream type's upcasters (if any), at the
        revision `revisions` gives."""
        if self._folds is None:
            for t, r in self.reducers.items():
                if r.declared is not None:
                    refuse_upcast(r.declared, t, sorted(self._chains_of(t)),
                                  f"the declared reducer of {t!r} in domain {r.domain!r}")
            self._folds = {t: self._with_upcasters(r) for t, r in self.reducers.items()}
        return self._folds

    def _chains_of(self, stream_type: str) -> dict[str, dict[int, Upcast]]:
        chains: dict[str, dict[int, Upcast]] = {}
        for (event_type, version), u in self.upcasters.items():
            if u.applies_to(stream_type):
                chains.setdefault(event_type, {})[version] = u.upcast
        return chains

    def _with_upcasters(self, reducer: Reducer) -> Reducer:
        chains = self._chains_of(reducer.stream_type)
        if not chains and self._version_source != "suffix":
            return reducer
        n = sum(len(c) for c in chains.values())
        return dataclasses.replace(reducer, revision=min(999, reducer.revision + n),
                                   fold=_Upcasting(reducer.fold, chains, self._version_source))

    @classmethod
    def merged(cls, domains: Iterable[Domain]) -> Domain:
        """One domain holding what each of `domains` registered (refused where two register the same stream type,
        or the same event type's version, or read schema versions from different places)."""
        listed = list(domains)
        sources = {d.schema_version for d in listed if d.upcasters or d.schema_version != "none"}
        if len(sources) > 1:
            raise DomainError(f"the domains {', '.join(d.name for d in listed)} read schema versions from "
                              f"{' and '.join(sorted(sources))}", "Read them from one place in every domain.")
        errors = {d.fold_errors for d in listed}
        out = cls(" + ".join(d.name for d in listed) or "none", schema_version=next(iter(sources), "none"),
                  fold_errors="stop" if "stop" in errors else "quarantine")
        for d in listed:
            for r in d.reducers.values():
                out.add(r)
            for u in d.upcasters.values():
                out.add_upcaster(u)
            for p in d.projections.values():
                out.add_projection(p)
            for event_type, schema in d.event_schemas.items():
                out.event_schema(event_type, schema)
        return out


_SUFFIX = re.compile(r"^(?P<base>.+?)[._][vV](?P<version>\d+)$")


class _Upcasting:
    """A reducer behind its upcasters: each event's payload brought to its type's current shape first (a class,
    not a closure, so that Spark's workers receive it by value and the reducer by reference)."""

    __slots__ = ("fold", "chains", "source")

    def __init__(self, fold: Fold, chains: dict[str, dict[int, Upcast]], source: str) -> None:
        self.fold, self.chains, self.source = fold, chains, source

    def __call__(self, state: State, event: Event) -> State:
        return self.fold(state, self.upcast(event))

    def upcast(self, event: Event) -> Event:
        event_type, version, payload = event.event_type, 1, event.payload
        if self.source == "suffix":
            m = _SUFFIX.match(event_type)
            if m is not None:
                event_type, version = m.group("base"), int(m.group("version"))
        elif self.source != "none" and isinstance(payload, dict):
            held = payload.get(self.source[len("field:"):])
            version = held if isinstance(held, int) and not isinstance(held, bool) else 1
        chain = self.chains.get(event_type)
        if chain:
            while version in chain:
                payload = chain[version](payload)
                version += 1
        if event_type is not event.event_type or payload is not event.payload:
            event = Event(event.stream_id, event.version, event_type, payload)
        return event


def _identity(state: State, event: Event) -> State:
    return state


# The columns a typed state table has besides the state's fields (lake/state/typed_state.py): no field may take one.
ENVELOPE = ("tenant", "stream_id", "version", "last_event_at", "revision", "updated_at", "quarantined")
# The columns a cross-stream projection's table has besides its key and its state's fields (lake/cross_stream.py).
PROJECTION_ENVELOPE = ("tenant", "state", "events", "last_stream_id", "last_version", "last_batch_id",
                       "last_position", "last_event_at", "revision", "updated_at", "quarantined", "parked")
UTC_MICROS = pa.timestamp("us", tz="UTC")  # a moment, as every table es_pipeline keeps holds it (Delta's TIMESTAMP)
_SCALARS: dict[Any, pa.DataType] = {
    str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_(), bytes: pa.binary(),
    dt.datetime: UTC_MICROS, dt.date: pa.date32(),
}


def state_schema(spec: Any, what: str, envelope: Sequence[str] = ENVELOPE) -> pa.Schema:
    """A state declaration (a dataclass, a TypedDict or an Arrow schema) as an Arrow schema of nullable fields."""
    if isinstance(spec, pa.Schema):
        schema = spec
    elif isinstance(spec, type) and (dataclasses.is_dataclass(spec) or typing.is_typeddict(spec)):
        schema = pa.schema(_fields(spec, what))
    else:
        raise DomainError(f"{what} is declared as {spec!r}",
                          "Declare it as a dataclass, a TypedDict or a pyarrow schema.")
    taken = [f.name for f in schema if f.name in envelope]
    if taken:
        raise DomainError(f"{what} has fields named {', '.join(taken)}, which its typed table's own columns take "
                          f"({', '.join(envelope)})", "Rename those fields of the state.")
    fields = []
    for f in schema:
        try:  # as its Delta table holds it: timestamps in microseconds, UTC where zoned; no time of day
            fields.append(pa.field(f.name, declared_type(f.type)))
        except ValueError as exc:
            raise DomainError(f"{what}, field {f.name!r}: {exc}",
                              "Declare the field with a type its typed table can hold (docs/analysts.md).") from exc
    return pa.schema(fields)


def declared_type(t: pa.DataType) -> pa.DataType:
    """A declared column type as its Delta table holds it (a timestamp in microseconds, UTC where it has a zone; a
    date as `date32`; plain strings, binaries and lists), or ValueError saying why no JSON value can go there."""
    if pa.types.is_struct(t):
        return pa.struct([pa.field(t.field(i).name, declared_type(t.field(i).type)) for i in range(t.num_fields)])
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(declared_type(t.value_type))
    if pa.types.is_map(t):
        if not (pa.types.is_string(t.key_type) or pa.types.is_large_string(t.key_type)):
            raise ValueError(f"a map's keys are JSON object keys, strings, not {t.key_type}")
        return pa.map_(pa.string(), declared_type(t.item_type))
    if pa.types.is_unsigned_integer(t):
        raise ValueError(f"Delta Lake has no unsigned integers ({t}): declare int64")
    if pa.types.is_time(t):
        raise ValueError(f"Delta Lake has no time of day type ({t}): declare a string, or a timestamp")
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz="UTC" if t.tz else None)
    if pa.types.is_date(t):
        return pa.date32()
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return pa.binary()
    if pa.types.is_decimal(t):
        if t.precision > 38:
            raise ValueError(f"Delta Lake's decimals hold at most 38 digits ({t})")
        return pa.decimal128(t.precision, t.scale)
    if pa.types.is_boolean(t) or pa.types.is_signed_integer(t) or t in (pa.float32(), pa.float64()):
        return t
    raise ValueError(f"no JSON value converts to {t}")


def _fields(spec: type, what: str) -> list[pa.Field]:
    try:
        hints = typing.get_type_hints(spec)
    except NameError as exc:
        raise DomainError(f"{what}: the type hints of {spec.__qualname__} cannot be resolved ({exc})",
                          "Declare the state's classes at a module's top level.") from exc
    names = [f.name for f in dataclasses.fields(spec)] if dataclasses.is_dataclass(spec) else list(hints)
    return [pa.field(name, _arrow_type(hints[name], f"{what}, field {name!r}")) for name in names]


def _arrow_type(hint: Any, what: str) -> pa.DataType:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        if len(kept) == 1:
            return _arrow_type(kept[0], what)
    elif hint in _SCALARS:
        return _SCALARS[hint]
    elif origin in (list, tuple, Sequence) and args:
        return pa.list_(_arrow_type(args[0], what))
    elif origin is dict and len(args) == 2:
        return pa.map_(_arrow_type(args[0], what), _arrow_type(args[1], what))
    elif isinstance(hint, type) and (dataclasses.is_dataclass(hint) or typing.is_typeddict(hint)):
        return pa.struct(_fields(hint, what))
    raise DomainError(f"{what} has type {hint!r}, which has no column type",
                      "Use str, int, float, bool, bytes, datetime, date, list[...], dict[str, ...], a nested "
                      "dataclass or TypedDict, or X | None; or declare the state as a pyarrow schema.")


def _name(reducer: Reducer) -> str:
    fn = reducer.fold
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


NO_DOMAIN = Domain("none")  # a store's events, with no reducer: every stream's row without state


def load(modules: Sequence[str], origin: str = "ES_PIPELINE_DOMAIN") -> Domain:
    """The domain that `modules` register (each module's `Domain` objects, or the one its `:attribute` names),
    merged; `NO_DOMAIN` for none. Imports them: what a module registers at import is registered then. `origin`
    is what named the modules, for the errors (`Settings.origin`: the variable, or a component's attribute)."""
    found: list[Domain] = []
    for spec in modules:
        name, _, attribute = spec.partition(":")
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise DomainError(
                f"{origin} names module {name!r}, which cannot be imported ({exc})",
                "Install the team's package into es_pipeline's environment (`uv pip install -e path/to/package`, "
                "or a dependency of the project) and check the module's name.") from exc
        if attribute:
            value = getattr(module, attribute, None)
            if not isinstance(value, Domain):
                raise DomainError(f"{origin} names {spec!r}, which is not a Domain ({type(value).__name__})",
                                  f"Name a module, or a `Domain` object in it (`{name}:domain`).")
            found.append(value)
            continue
        held = [v for v in vars(module).values() if isinstance(v, Domain)]
        unique = list({id(d): d for d in held}.values())
        if not unique:
            raise DomainError(f"module {name!r} ({origin}) holds no Domain",
                              "Make one there (`domain = Domain(\"name\")`) and register the reducers on it.")
        found.extend(unique)
    if not found:
        return NO_DOMAIN
    return found[0] if len(found) == 1 else Domain.merged(found)
