"""Cross-stream projections: a team's fold of chosen event types from every stream, grouped by a key read from
the payload (a customer id, an account id), one row per (tenant, key), kept incrementally and exactly once.

A team declares one in its package (`Domain.projection`, docs/domain.md); its table is an instance of `Table`
named after it. What a row holds is the fold of its key's events in **the lake's order**: `(batch_id,
global_position, stream_id, version)`, the extraction batch that brought the event, then the store's position
within it (through a move of the store, the rebase's batch: docs/domain.md, "The order of events"). That order is
a property of the rows themselves, so an increment and a rebuild fold the same events in the same order and agree
(docs/decisions.md, "Cross-stream order").

Batches reach the lake out of their id order (ranges extract concurrently). A batch is folded once no batch of a
lower id can still come: the frontier F, the lowest batch id the store's offsets still hold pending (or the next
one it will give), read before the lake. Events of batches at or above F wait, in `events`, for the next update.
Three numbers, each a Delta transaction id of the table committed with its rows, say what is folded:

- `es_pipeline.<name>`: the `events` version read up to (V);
- `es_pipeline.<name>.cursor`: every row of the `events` commits up to it is folded (C <= V);
- `es_pipeline.<name>.frontier`: of the commits after C up to V, the rows of batches below it are (F).

An update reads `events`' change feed after C, folds what is new below the new frontier onto each key's state,
and commits the three with the rows. An event that still sorts before its key's last folded one (a restored tail
caught up by an older release, batch 0; a batch whose id was reused) makes that key fold again from all its
events in `events`: slower, never wrong. A first build, a changed definition or revision, a feed that cannot be read (vacuumed, or
larger than `feed.SMALL_INCREMENT`), or a tenant's erasure (it records frontier 0) folds every key from `events`.

No JVM: the fold is plain Python per event, as reducers are (lake/state/fold.py); the table is written by delta-rs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import zlib
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import cached_property
from typing import TYPE_CHECKING

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
from deltalake import DeltaTable, write_deltalake

from es_pipeline.domain import RESERVED_PREFIXES, Domain, Event, Projection
from es_pipeline.errors import ProjectionFoldError
from es_pipeline.lake.delta import arrow_append, current, pieces, tables
from es_pipeline.lake.delta.definition import Reconciled, Table, over, rows_off
from es_pipeline.lake.delta.tables import UTC_MICROS, Location
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel import dead_letters, feed, position, runner
from es_pipeline.lake.kernel.engine import HERE, Engine
from es_pipeline.lake.kernel.feed import Feed
from es_pipeline.lake.kernel.position import Position
from es_pipeline.lake.kernel.projection import Increment, Kind
from es_pipeline.lake.kernel.result import Ran, Result
from es_pipeline.lake.kernel.turn import Turn
from es_pipeline.lake.state import forked, state_json
from es_pipeline.lake.state.fold import with_schema_versions
from es_pipeline.source import payloads

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

KIND = "es_pipeline.cross_stream"  # the table property that marks a cross-stream projection (its definition)
# The `events` columns a projection reads (the change feed's commit version besides, on an increment).
COLUMNS = ["tenant", "stream_id", "stream_type", "version", "event_type", "payload", "payload_encoding",
           "recorded_at", "batch_id", "global_position"]
NO_FRONTIER = 1 << 62  # without a store to ask: every batch the lake holds is folded (late ones fold their key again)

Frontier = Callable[[], int]


def columns_of(domain: Domain) -> list[str]:
    """The `events` columns a projection of `domain` reads: `COLUMNS`, and `metadata` if versions are read there."""
    return [*COLUMNS, "metadata"] if domain.metadata_field is not None else list(COLUMNS)


def definition_of(projection: Projection, domain: Domain) -> str:
    """What the projection's rows depend on besides its fold's code: its definition, and the upcasters of its event
    types and where their versions are read. A change of it rebuilds the table (as a revision does)."""
    upcasters = sorted(f"{u.event_type}@{u.version}:{getattr(u.upcast, '__module__', '?')}."
                       f"{getattr(u.upcast, '__qualname__', '?')}" for u in domain.upcasters.values()
                       if u.event_type in projection.event_types)
    return f"{projection.definition};versions={domain.schema_version};upcasters={','.join(upcasters)}"


def table_of(projection: Projection, domain: Domain) -> Table:
    """The projection's table: tenant and key, the state as JSON, what was folded last, then the declared fields."""
    schema = pa.schema([
        ("tenant", pa.string()), (projection.key_column, pa.string()), ("state", pa.string()),
        ("events", pa.int64()), ("last_stream_id", pa.string()), ("last_version", pa.int32()),
        ("last_batch_id", pa.int64()), ("last_position", pa.int64()), ("last_event_at", UTC_MICROS),
        ("revision", pa.int32()), ("updated_at", UTC_MICROS),
        ("quarantined", pa.string()), ("parked", pa.string()),  # a key held at its last good state (decision 0051)
        *(projection.state or []),
    ])
    return Table(projection.name, schema, key=("tenant", projection.key_column),
                 comment=f"cross-stream projection {projection.name} ({projection.domain}): "
                         f"{', '.join(projection.event_types)} by {projection.key_column}",
                 properties={KIND: definition_of(projection, domain)},
                 app=_unbound_seen(projection.name, definition_of(projection, domain)))


def table_names(warehouse: Location) -> list[str]:
    """The cross-stream projection tables in the lake now (whatever the domain), by name."""
    known = {*tables.TABLES, "event_tables"}  # the typed event tables' (lake/typed/event_tables.py), named below
    names = [n for n in tables.table_names(warehouse, "") if n not in known
             and not n.startswith(RESERVED_PREFIXES)]
    return [n for n in names if KIND in DeltaTable(tables.table_path(warehouse, n)).metadata().configuration]


def result(name: str, rows: int, now: int, previous: int, folded: int, *, keys: int, refolded: int = 0,
           waiting: int = 0, without_key: int = 0, frontier: int, engine: Ran = "local", out: pa.Table | None = None,
           keyless: int = 0) -> Result:
    """What an update of projection `name` did, as the kernel's `Result`: short of `events` while events wait for the
    frontier (a later update folds them), however many it folded. `out`: the rows it wrote (every held key is among
    them: each update tries them again), for the keys quarantined; `keyless`: events whose key function failed."""
    held = 0 if out is None or "quarantined" not in out.column_names else int(
        pc.sum(pc.is_valid(out["quarantined"])).as_py() or 0)
    return Result(name, now, previous, folded, engine, rows, {
        "keys_updated": keys, "keys_refolded": refolded, "events_waiting": waiting, "events_without_key": without_key,
        "keys_quarantined": held, "events_key_failed": keyless, "batch_frontier": frontier},
        short=f"{waiting:,} events wait for the batch frontier {frontier}" if waiting else None)


def update(
    warehouse: Location, domain: Domain, name: str, *, store_dsn: str | None = None,
    frontier: Frontier | None = None, engine: Engine = HERE,
) -> Result:
    """Bring projection `name` of `domain` up to `events` now (module docstring), one update at a time with
    `store_dsn`, by the kernel's runner. `frontier`: the lowest batch id that may still reach the lake
    (`extraction.offsets.batch_frontier`); None: every batch the lake holds is final. `engine`: where a whole build
    runs (the engine rule, applied by the kernel's runner); increments always run here. `NoEventsYet` before
    `events` exists."""
    return runner.update(CrossStream(domain.projections[name], domain, frontier, warehouse), engine, warehouse,
                         store_dsn=store_dsn)


class CrossStream(Kind):
    """A cross-stream projection as a kind of the projection kernel (lake/kernel/projection.py): its position keeps
    a cursor and a frontier besides the `events` version read (module docstring). `frontier` is read once per
    update, in its turn, before the lake (`start`)."""

    keeps_cursor = True
    increments_in_process = True

    def __init__(self, projection: Projection, domain: Domain, frontier: Frontier | None = None,
                 warehouse: Location | None = None) -> None:
        self.projection, self.domain, self.warehouse = projection, domain, warehouse
        self.frontier_of, self.frontier = frontier, NO_FRONTIER
        self.table = table_of(projection, domain)
        self.name = projection.name
        self.columns = [*columns_of(domain), "_commit_version"]

    def start(self) -> None:
        # The frontier first, then the lake: a batch below it is in every version of `events` read after.
        self.frontier = NO_FRONTIER if self.frontier_of is None else self.frontier_of()

    def takes_increment(self, position: Position, now: int) -> bool:
        # Frontier 0: marked for a whole build (a tenant's erasure); a position past `events`: another `events`.
        return bool(position.cursor is not None and position.frontier and position.read is not None
                    and position.read <= now)

    def ready(self, path: str, target: DeltaTable, events_id: str) -> DeltaTable | None:
        return target if tables.has_columns(target, self.table.schema.names) else None

    def up_to_date(self, target: DeltaTable, position: Position, now: int) -> Result:
        assert position.read is not None and position.frontier is not None
        if self.warehouse is not None:  # a crash between an update's commit and its dead letters: mended now
            dead_letters.follow(self.warehouse, self.name, self.table.key[1])
        return result(self.name, current.row_count(target), now, position.read, 0, keys=0,
                      frontier=position.frontier)

    def fold(self, rows: pa.Table, increment: Increment) -> _Folded:
        return _increment(self, rows, increment)

    def build_here(self, warehouse: Location, turn: Turn, engine: Engine) -> Result | None:
        events_path = EVENTS.path(warehouse)
        events = DeltaTable(events_path)
        read, frontier = self._held(warehouse, events)
        return _build(warehouse, self.projection, self.domain, self.table, turn, events_path, events, frontier,
                      read=read)

    def update_on_spark(self, spark: SparkSession, warehouse: Location, turn: Turn) -> Result:
        events_path = EVENTS.path(warehouse)
        events = DeltaTable(events_path)
        read, frontier = self._held(warehouse, events)
        return _build_with_spark(spark, warehouse, self.projection, self.domain, self.table, turn, events_path, events,
                                 frontier, read=read)

    def _held(self, warehouse: Location, events: DeltaTable) -> tuple[int | None, int]:
        """What a whole build of `events` goes on from: the `events` version the table read (its turn confirms it),
        and the frontier to record, the one read (never below the one recorded: it only moves up)."""
        at = Position.of(self.table.path(warehouse), self.table.app_id_over(str(events.metadata().id)), cursor=True)
        return at.read, max(self.frontier, at.frontier or 0)


def reconcile(warehouse: Location, domain: Domain, name: str) -> Reconciled:
    """Projection `name` (one snapshot of its table) against `events` at the version it read (V): each key's
    `events` equals the events of its types there that have the key, less those still waiting (rows of the commits
    after its cursor, in batches at or above its frontier: folded by a later update). Like with like, so it cannot
    flap; the keys are read as the fold reads them (in this process, as the fold runs; `events` a million events
    at a time)."""
    projection = domain.projections[name]
    table = table_of(projection, domain)
    path, events_path = table.path(warehouse), EVENTS.path(warehouse)
    if not tables.is_delta_table(path) or not tables.is_delta_table(events_path):
        return Reconciled(None, note=f"{name} not built yet")
    target = DeltaTable(path)
    definition = target.metadata().configuration.get(KIND)
    ids = app_ids(name, definition or "", tables.table_id(events_path))
    seen, cursor, frontier = (target.transaction_version(a) for a in ids)
    if definition != table.properties[KIND] or seen is None or cursor is None or frontier is None:
        return Reconciled(None, note=f"{name} not built from this `events` and definition yet: its next update builds it")
    events = DeltaTable(events_path, version=int(seen))
    waiting: pa.Array | None = None
    if cursor < seen:
        later = feed.new_rows(events, int(cursor), int(seen), [*KEY_COLUMNS, "batch_id"], whole=True)
        if later is None:
            return Reconciled(None, note=f"`events`' change feed after version {cursor} is gone (vacuumed): "
                                         "the rows still waiting cannot be told apart")
        waiting = _event_keys(later.filter(pc.greater_equal(pc.fill_null(later["batch_id"], 0), int(frontier))))
    # Each key's events counted a million events at a time (lake/delta/pieces.py), each step added to those before.
    counts = pa.table({"tenant": pa.array([], pa.string()), "key": pa.array([], pa.string()),
                       "count_all": pa.array([], pa.int64())})
    for rows in _parts(events_path, events, columns_of(domain), lambda part: _of_types(part, projection, domain)):
        if waiting is not None:
            rows = rows.filter(pc.invert(pc.is_in(_event_keys(rows), waiting)))
        base, _ = _key_rows(rows, projection, domain)
        step = base.filter(pc.is_valid(base["key"])).group_by(["tenant", "key"]).aggregate([([], "count_all")])
        counts = pa.concat_tables([counts, step.cast(counts.schema)]).group_by(["tenant", "key"]).aggregate(
            [("count_all", "sum")]).rename_columns(["tenant", "key", "count_all"])
    expected = pa.table({"tenant": counts["tenant"], projection.key_column: counts["key"].cast(pa.string()),
                         "events": counts["count_all"].cast(pa.int64())})
    held = ["quarantined"] if tables.has_columns(target, ["quarantined"]) else []
    rows = current.files(path, target).to_table(columns=[*expected.column_names, *held])
    if held:  # a held key (docs/decisions/0051) has folded its events before the failing one only: left out, as
        # stream_state's check leaves its held streams out (the quarantine has its own alert)
        pairs = lambda t: pc.binary_join_element_wise(t["tenant"], t[projection.key_column], "\x00")  # noqa: E731
        out = pairs(rows.filter(pc.is_valid(rows["quarantined"])))
        rows = rows.filter(pc.is_null(rows["quarantined"])).drop_columns(held)
        expected = expected.filter(pc.invert(pc.is_in(pairs(expected), out)))
    n, examples = rows_off(expected, rows, ["tenant", projection.key_column])
    return Reconciled(int(seen), n, examples, engine="local")


KEY_COLUMNS = ("tenant", "stream_id", "version")


def _event_keys(rows: pa.Table) -> pa.Array:
    """Each row's event key as one string (tenant, stream id, version)."""
    return pc.binary_join_element_wise(tables.keys_tenant(rows), rows["stream_id"].cast(pa.string()),
                                       rows["version"].cast(pa.string()), "\x00")


def increment(warehouse: Location, projection: Projection, domain: Domain, turn: Turn, frontier: Frontier | None,
              events_feed: Feed | None = None) -> Result | None:
    """The increment in the table's `turn` (a follow's), or None: a whole build, the automation's run's to do."""
    return runner.increment(CrossStream(projection, domain, frontier, warehouse), warehouse, turn, events_feed)


def retry(warehouse: Location, domain: Domain, name: str, *, store_dsn: str | None = None,
          frontier: Frontier | None = None) -> Result | None:
    """Projection `name`'s held keys folded again now with the code as deployed, no event being new (every increment
    does it too): by the kernel's runner (`runner.retry`). `frontier` as for `update` (the store's: a frontier is
    recorded, and only moves up). None: behind `events`, or not built: an update does it."""
    return runner.retry(CrossStream(domain.projections[name], domain, frontier, warehouse), warehouse,
                        store_dsn=store_dsn)


def mark_for_rebuild(warehouse: Location, name: str, events_id: str) -> None:
    """After a tenant's erasure: the projection's next update folds every key from `events` (of Delta id
    `events_id`) again (frontier 0), so that none of the erased events waiting in `events`' change feed comes back.
    Without an `events` (""), there is no position to mark: its next update builds it whole anyway."""
    target = DeltaTable(tables.table_path(warehouse, name))
    definition = target.metadata().configuration.get(KIND)
    if definition is not None and events_id:
        position.record(target, position.commit_properties(app_ids(name, definition, events_id)[2], 0))


def app_ids(name: str, definition: str, events_id: str) -> tuple[str, str, str]:
    """The Delta app ids of the three numbers (module docstring), of this definition over the `events` table of
    Delta id `events_id`: a changed definition, or another `events` (the lake rebuilt), finds none and builds
    whole (so the table property `KIND`, set before the rows, never vouches for rows of another)."""
    seen = over(_unbound_seen(name, definition), events_id)
    return seen, f"{seen}.cursor", f"{seen}.frontier"


def _unbound_seen(name: str, definition: str) -> str:
    """The app id an older es_pipeline kept `seen` under, before ids named their `events` (fenced at a build)."""
    return f"es_pipeline.{name}.{hashlib.sha256(definition.encode()).hexdigest()[:12]}"


# -- reading and ordering events -----------------------------------------------------------------------


@dataclass
class _Keyed:
    """The events of one read with their keys (tenant, key, batch, position, stream_id, stream_type, version,
    event_type, payload, at, and the tenant's and key's dictionary codes) and `order`, the row indices sorted by
    tenant, key and the lake's order: rows are taken in that order where they are folded."""

    rows: pa.Table
    order: pa.Array
    events: list[Event] | None  # parsed and upcast already (read for their keys), in `rows`' order; None: not yet
    without_key: int
    failed: pa.Table | None = None  # under quarantine, the events whose key function failed (`dead_keys`)

    @property
    def count(self) -> int:
        return self.rows.num_rows

    @cached_property
    def starts(self) -> list[int]:
        """The position in `order` where each (tenant, key) begins (computed once per read)."""
        if not self.count:
            return []
        t, k = self.rows["tcode"].take(self.order), self.rows["kcode"].take(self.order)
        changed = pc.or_(pc.not_equal(t[1:], t[:-1]), pc.not_equal(k[1:], k[:-1]))
        return [0, *(i + 1 for i in pc.indices_nonzero(changed).to_pylist())]

    def firsts(self) -> dict[tuple[str, str], tuple[int, int, str, int]]:
        """Each (tenant, key)'s first event in the lake's order: (batch, position, stream, version)."""
        rows = self.rows.take(self.order.take(pa.array(self.starts, pa.int64())))
        tenant, key, batch, position, sid, version = (rows[c].to_pylist() for c in (
            "tenant", "key", "batch", "position", "stream_id", "version"))
        return {(t, k): (b, p, s, v) for t, k, b, p, s, v in zip(tenant, key, batch, position, sid, version, strict=True)}

    def only(self, keys: set[tuple[str, str]], keep: bool = True) -> _Keyed:
        """The rows of `keys` (or, `keep=False`, of every other key)."""
        held = pc.is_in(_pairs(self.rows), pa.array(sorted(f"{t}\x00{k}" for t, k in keys), pa.string()))
        mask = held if keep else pc.invert(held)
        events = None if self.events is None else [e for e, m in zip(self.events, mask.to_pylist(), strict=True) if m]
        rows = self.rows.filter(mask)
        return _Keyed(rows, _sorted(rows), events, self.without_key)


def _pairs(rows: pa.Table) -> pa.Array:
    return pc.binary_join_element_wise(rows["tenant"], rows["key"], "\x00")


def _of_types(rows: pa.Table, projection: Projection, domain: Domain) -> pa.Table:
    """The rows of the projection's event types (any version suffix, where versions are read from there)."""
    if not rows.num_rows:
        return rows
    wanted = set(projection.event_types)
    held = [t for t in pc.unique(rows["event_type"]).to_pylist() if t is not None and domain.base_type(t) in wanted]
    return rows.filter(pc.is_in(rows["event_type"], pa.array(held, pa.string())))


_KEY_TYPES = (pa.string(), pa.large_string(), pa.int64(), pa.int32(), pa.null())


def _arrow_keys(payload: pa.ChunkedArray | pa.Array, projection: Projection, domain: Domain) -> pa.Array | None:
    """The key of every payload read by Arrow's JSON reader, where that gives what `Projection.key_of` gives: a payload
    field's name as the key, no upcaster that could change it, and the field a string or a whole number wherever it
    is. None: read in Python instead (`_keyed`)."""
    field = projection.key
    if not isinstance(field, str) or any(domain.base_type(u.event_type) in projection.event_types
                                         for u in domain.upcasters.values()):
        return None
    whole = payload.combine_chunks() if isinstance(payload, pa.ChunkedArray) else payload
    parts = []
    for lo in range(0, len(whole), _JSON_ROWS):
        part = _arrow_key_part(whole.slice(lo, _JSON_ROWS), field)
        if part is None:
            return None
        parts.append(part)
    return pa.concat_arrays(parts) if parts else pa.array([], pa.string())


_JSON_ROWS = 200_000  # payloads read by Arrow's JSON reader at a time


def _arrow_key_part(payload: pa.Array, field: str) -> pa.Array | None:
    n = len(payload)
    try:
        lines = pc.binary_join(pa.ListArray.from_arrays(pa.array([0, n], pa.int32()), payload), "\n")
        read = pa_json.read_json(pa.BufferReader(lines[0].as_buffer()),
                                 read_options=pa_json.ReadOptions(block_size=1 << 26))
    except pa.ArrowException:
        return None  # a field of two types, a payload that is no object, JSON across lines, past 2 GB: Python reads them
    if read.num_rows != n:
        return None
    if field not in read.column_names:
        return pa.nulls(n, pa.string())
    column = read[field]
    if column.type not in _KEY_TYPES:
        return None  # a float, a bool, an object: Python's str() of them is the key
    return column.combine_chunks().cast(pa.string()) if column.num_chunks else pa.nulls(n, pa.string())


def _keyed(rows: pa.Table, projection: Projection, domain: Domain) -> _Keyed:
    """Each row keyed (a row without a key is counted and left out; one whose key function failed, under quarantine,
    kept in `failed`) and sorted by tenant, key and the lake's order."""
    n = rows.num_rows
    base, events = _key_rows(rows, projection, domain)
    has_key = pc.is_valid(base["key"])
    if events is not None:
        events = [e for e, k in zip(events, has_key.to_pylist(), strict=True) if k]
    keyed = _ordered(base.filter(has_key).drop_columns(["key_error"]), events,
                     n - int(pc.sum(has_key.cast(pa.int64())).as_py() or 0))
    return replace(keyed, failed=base.filter(pc.is_valid(base["key_error"])))


def _ordered(kept: pa.Table, events: list[Event] | None, without_key: int) -> _Keyed:
    """Keyed rows sorted by tenant, key and the lake's order."""
    # Dictionary codes group the rows without comparing strings; the lake's order within a key is compared whole.
    kept = kept.append_column("tcode", pc.dictionary_encode(kept["tenant"]).combine_chunks().indices) \
        .append_column("kcode", pc.dictionary_encode(kept["key"]).combine_chunks().indices)
    return _Keyed(kept, _sorted(kept), events, without_key)


def _key_rows(rows: pa.Table, projection: Projection, domain: Domain) -> tuple[pa.Table, list[Event] | None]:
    """`events` rows as the fold takes them (`_KEYED`'s columns), each with its key (null: none), and the events
    parsed on the way (None where Arrow read the keys). Keys are read by Arrow where it can (`_arrow_keys`), else
    each payload is parsed, upcast and keyed here."""
    rows = with_schema_versions(payloads.for_reducers(tables.tenant_filled(rows)), domain)
    base = pa.table({
        "tenant": rows["tenant"], "stream_id": rows["stream_id"], "stream_type": rows["stream_type"],
        "version": rows["version"].cast(pa.int32()), "event_type": rows["event_type"], "payload": rows["payload"],
        "batch": pc.fill_null(rows["batch_id"].cast(pa.int64()), 0),
        "position": pc.fill_null(rows["global_position"].cast(pa.int64()), -1),
        "at": rows["recorded_at"].cast(UTC_MICROS).cast(pa.int64()),
    })
    keys = _arrow_keys(base["payload"], projection, domain)
    events: list[Event] | None = None
    errors: pa.Array = pa.nulls(base.num_rows, pa.string())
    if keys is None:
        keys, events, errors = _python_keys(base, projection, domain)
    return base.append_column("key", keys).append_column("key_error", errors), events


ORDER = ("batch", "position", "stream_id", "version")  # a key's events, in the lake's order


def _sorted(rows: pa.Table) -> pa.Array:
    return pc.sort_indices(rows, sort_keys=[(c, "ascending") for c in ("tcode", "kcode", *ORDER)])


def _python_keys(base: pa.Table, projection: Projection,
                 domain: Domain) -> tuple[pa.Array, list[Event] | None, pa.Array]:
    """Each payload parsed, upcast and keyed in Python: (the keys, the events as parsed, for the fold to reuse). A
    large read is keyed over one forked process per core, and its events parsed again by the fold's processes
    (None): keeping millions of parsed events would cost more memory than parsing twice costs time."""
    n = base.num_rows
    shares = forked.shares(n)
    if shares == 1:
        keys, events, errors = _key_span(base, projection, domain, keep=True)
        return pa.array(keys, pa.string()), events, pa.array(errors, pa.string())
    cuts = [n * i // shares for i in range(shares + 1)]
    parts = forked.run((base, projection, domain), _key_share, cuts[:-1], cuts[1:])
    return pa.concat_arrays([k for k, _ in parts]), None, pa.concat_arrays([e for _, e in parts])


def _key_share(lo: int, hi: int) -> tuple[pa.Array, pa.Array]:
    base, projection, domain = forked.shared()
    keys, _, errors = _key_span(base.slice(lo, hi - lo), projection, domain, keep=False)
    return pa.array(keys, pa.string()), pa.array(errors, pa.string())


def _key_span(
    base: pa.Table, projection: Projection, domain: Domain, *, keep: bool
) -> tuple[list[str | None], list[Event] | None, list[str | None]]:
    """Each row's key (None: none), its event parsed (`keep`), and, under quarantine, why its key could not be read
    (JSON [kind, message]; such an event has no key: it goes to the dead letters)."""
    sid, stype, version = (base[c].to_pylist() for c in ("stream_id", "stream_type", "version"))
    etype, payload = base["event_type"].to_pylist(), base["payload"].to_pylist()
    key_of, upcast, rewrites = projection.key_of, domain.upcast, domain.rewrites_events
    keys: list[str | None] = []
    events: list[Event] = []
    errors: list[str | None] = []
    for i in range(base.num_rows):
        try:
            event = _event(payload[i], sid[i], version[i], etype[i], stype[i], upcast if rewrites else None)
            k = key_of(event)
        except Exception as exc:  # noqa: BLE001 - a key function's failure is reported with its place
            if not domain.quarantines:
                raise ProjectionFoldError(projection.name, None, sid[i], version[i], etype[i],
                                          f"its key: {type(exc).__name__}: {exc}") from None
            keys.append(None)
            errors.append(json.dumps([type(exc).__name__, f"its key: {type(exc).__name__}: {exc}"]))
            if keep:
                events.append(_new_event(Event, (sid[i], version[i], etype[i], {})))
            continue
        keys.append(None if k is None else str(k))
        errors.append(None)
        if keep:
            events.append(event)
    return keys, events if keep else None, errors


_new_event = tuple.__new__  # Event(...) without its Python-level __new__: one per event folded


def _event(text: str, stream_id: str, version: int, event_type: str, stream_type: str,
           upcast: Callable[[str, Event], Event] | None) -> Event:
    """One `events` row as the key function and the fold see it: its payload parsed (orjson, or json for what
    orjson refuses), upcast where the domain rewrites events."""
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        data = json.loads(text)
    event = _new_event(Event, (stream_id, version, event_type, data))
    return event if upcast is None else upcast(stream_type, event)


def _whole(
    events_path: str, events: DeltaTable, wanted: list[str], rows_of: Callable[[pa.Table], pa.Table]
) -> pa.Table:
    """The rows of `events` at its version (the `wanted` columns it has), each batch of files filtered by `rows_of`:
    the version the update records, so that no later commit's row is folded here and again from the feed."""
    out = list(_parts(events_path, events, wanted, rows_of))
    return pa.concat_tables(out) if out else _parts_schema(events, wanted).empty_table()


def _parts(
    events_path: str, events: DeltaTable, wanted: list[str], rows_of: Callable[[pa.Table], pa.Table]
) -> Iterator[pa.Table]:
    """`_whole`'s rows a million events read at a time (lake/delta/pieces.py), never all at once."""
    for part in pieces.chunks(pieces.batches(events_path, events, wanted)):
        rows = rows_of(part)
        for c in wanted:
            if c not in rows.column_names:
                rows = rows.append_column(c, pa.nulls(rows.num_rows, _MISSING.get(c, pa.string())))
        yield rows.select(wanted)


_MISSING = {"batch_id": pa.int64(), "global_position": pa.int64()}  # a lake of an older release: null batch, position


def _parts_schema(events: DeltaTable, wanted: list[str]) -> pa.Schema:
    held = pieces.schema(events, wanted)
    return pa.schema([held.field(c) if c in held.names else pa.field(c, _MISSING.get(c, pa.string())) for c in wanted])


# -- folding -----------------------------------------------------------------------------------------


@dataclass
class _Row:
    state: dict
    events: int
    last: tuple[int, int, str, int] | None
    last_at: int | None
    text: str | None = None  # the state as read from the table (a prior row): what a refold starts from
    quarantined: dict | None = None  # held at its last good state (docs/decisions/0051): where and why
    parked: list | None = None  # then: the failing event and every later one of the key, waiting (`_Parked`)


# A key's event as the fold takes it: (stream_id, stream_type, version, event_type, payload text, batch, position,
# recorded_at in microseconds, the event parsed already or None).
_Taken = tuple[str, str, int, str, str, int, int, "int | None", "Event | None"]
_PARKED = ("stream_id", "stream_type", "version", "event_type", "payload", "batch", "position", "at")


def _fold_key(projection: Projection, domain: Domain, k: tuple[str, str], row: _Row, taken: list[_Taken]) -> _Row:
    """One key's events (in the lake's order) folded onto its prior `row`. A failure raises `ProjectionFoldError`; under
    quarantine (`Domain.fold_errors`) the key is held at its last good state instead: the fold of its events before
    the failing one, from the prior row's state as stored (a fold may have changed it in place before it raised), the
    failing event and every later one waiting in `parked`, `quarantined` saying where and why."""
    fold, upcast = projection.fold, domain.upcast if domain.rewrites_events else None
    state = row.state
    for j, (sid, stype, version, etype, payload, _, _, _, parsed) in enumerate(taken):
        try:
            event = parsed if parsed is not None else _event(payload, sid, version, etype, stype, upcast)
            state = fold(state, event)
        except Exception as exc:  # noqa: BLE001 - any fold failure is reported, with its place
            reason = f"the payload has no field {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            if not domain.quarantines:
                raise ProjectionFoldError(projection.name, k[1], sid, version, etype, reason) from None
            return _held(projection, domain, k, row, taken, j, type(exc).__name__, reason)
    if not taken:
        return row
    sid, _, version, _, _, batch, position, at, _ = taken[-1]
    return _Row(state, row.events + len(taken), (batch, position, sid, version), at)


def _held(projection: Projection, domain: Domain, k: tuple[str, str], row: _Row, taken: list[_Taken], failing: int,
          kind: str, reason: str) -> _Row:
    """Key `k` held at its last good state: `row` with `taken[:failing]` folded again from its stored state, the rest
    parked (`_fold_key`)."""
    codec = state_json.codec(projection.state)
    start = _Row(codec.loads(row.text) if row.text else {}, row.events, row.last, row.last_at, row.text)
    again = domain.folding("stop")
    good = _fold_key(projection, again, k, start, taken[:failing])  # deterministic folds: the state before it
    sid, _, version, etype, _, batch, position, _, _ = taken[failing]
    prior = row.quarantined if row.quarantined and row.quarantined.get("stream_id") == sid and \
        row.quarantined.get("version") == version else None
    held = {"stream_id": sid, "version": version, "event_type": etype, "batch": batch, "position": position,
            "kind": kind, "message": reason,
            "since": prior["since"] if prior else datetime.now(UTC).isoformat(timespec="seconds"),
            "retries": prior.get("retries", 0) + 1 if prior else 0}
    parked = [dict(zip(_PARKED, e[:8], strict=True)) for e in taken[failing:]]
    return _Row(good.state, good.events, good.last, good.last_at, None, held, parked)


def _fold(
    projection: Projection, domain: Domain, keyed: _Keyed, prior: dict[tuple[str, str], _Row]
) -> dict[tuple[str, str], _Row]:
    """Each key's events of `keyed` folded onto its `prior` row (or from nothing), in order: in this process, or
    over one forked process per core for a large read (whole keys each)."""
    starts = keyed.starts
    shares = forked.shares(keyed.count)
    bounds = [*starts, keyed.count]  # a cut falls where a key begins (or at the end: one key past the middle)
    cuts = [0] + [bounds[bisect_left(bounds, keyed.count * i // shares)] for i in range(1, shares)] + [keyed.count]
    spans = [(lo, hi) for lo, hi in zip(cuts, cuts[1:], strict=False) if lo < hi]
    out: dict[tuple[str, str], _Row] = {}
    for part in forked.run((projection, domain, keyed, prior), _fold_span, *zip(*spans, strict=True)) if spans else []:
        out.update(part)
    return out


def _fold_span(lo: int, hi: int) -> dict[tuple[str, str], _Row]:
    """The keys of rows lo..hi of the shared read, folded (whole keys: a span begins where a key does)."""
    projection, domain, keyed, prior = forked.shared()
    taken = keyed.order.slice(lo, hi - lo)
    rows = keyed.rows.take(taken)
    tenant, key, sid, stype = (rows[c].to_pylist() for c in ("tenant", "key", "stream_id", "stream_type"))
    version, etype, batch, position, at = (rows[c].to_pylist() for c in ("version", "event_type", "batch", "position",
                                                                           "at"))
    parsed = None if keyed.events is None else [keyed.events[i] for i in taken.to_pylist()]
    payload = rows["payload"].to_pylist()
    fold, upcast, out = projection.fold, domain.upcast if domain.rewrites_events else None, {}
    bounds = [s - lo for s in keyed.starts if lo <= s < hi] + [hi - lo]
    for i, end in zip(bounds, bounds[1:], strict=False):
        k = (tenant[i], key[i])
        row = prior.get(k) or _Row({}, 0, None, None)
        state = row.state
        j = i
        try:  # the loop of `_fold_key`, inline: one call per key, not per event
            for j in range(i, end):
                event = parsed[j] if parsed is not None else _event(payload[j], sid[j], version[j], etype[j], stype[j],
                                                                      upcast)
                state = fold(state, event)
        except Exception as exc:  # noqa: BLE001 - any fold failure is reported, with its place
            reason = f"the payload has no field {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            if not domain.quarantines:
                raise ProjectionFoldError(projection.name, k[1], sid[j], version[j], etype[j], reason) from None
            taken_rows: list[_Taken] = [(sid[x], stype[x], version[x], etype[x], payload[x], batch[x], position[x], at[x],
                                         None if parsed is None else parsed[x]) for x in range(i, end)]
            out[k] = _held(projection, domain, k, row, taken_rows, j - i, type(exc).__name__, reason)
            continue
        last = end - 1
        out[k] = _Row(state, row.events + (end - i), (batch[last], position[last], sid[last], version[last]), at[last])
    return out


def _table_rows(projection: Projection, table: Table, folded: dict[tuple[str, str], _Row]) -> pa.Table:
    """Folded rows in the table's schema, stamped now; the declared fields from the state."""
    keys = sorted(folded)
    rows = [folded[k] for k in keys]
    codec = state_json.codec(projection.state)
    states, texts = [], []
    for k, r in zip(keys, rows, strict=True):
        try:
            held = codec.to_json(r.state)
            texts.append(codec.text(held))
        except state_json.StateMisfit as misfit:
            sid, version = (r.last[2], r.last[3]) if r.last else (None, None)
            raise ProjectionFoldError(projection.name, k[1], sid, version, None, str(misfit)) from None
        states.append(held)
    n = len(rows)
    columns: list[pa.Array] = [
        pa.array([k[0] for k in keys], pa.string()), pa.array([k[1] for k in keys], pa.string()),
        pa.array(texts, pa.string()),
        pa.array([r.events for r in rows], pa.int64()),
        pa.array([r.last[2] if r.last else None for r in rows], pa.string()),
        pa.array([r.last[3] if r.last else None for r in rows], pa.int32()),
        pa.array([r.last[0] if r.last else None for r in rows], pa.int64()),
        pa.array([r.last[1] if r.last else None for r in rows], pa.int64()),
        pa.array([r.last_at for r in rows], pa.int64()).cast(UTC_MICROS),
        pa.array([projection.revision] * n, pa.int32()), pa.array([datetime.now(UTC)] * n, UTC_MICROS),
        pa.array([None if r.quarantined is None else json.dumps(r.quarantined) for r in rows], pa.string()),
        pa.array([None if not r.parked else json.dumps(r.parked) for r in rows], pa.string()),
    ]
    if projection.state is not None:
        columns.extend(state_json.columns(states, projection.state).columns)  # checked by `to_json` above
    return pa.Table.from_arrays(columns, schema=table.schema)


def _prior(target: DeltaTable, path: str, table: Table, wanted: set[tuple[str, str]],
           projection: Projection) -> dict[tuple[str, str], _Row]:
    """The table's rows of the `wanted` keys, as the fold goes on from them."""
    key_column = table.key[1]
    held = current.files(path, target).to_table(columns=[
        "tenant", key_column, "state", "events", "last_stream_id", "last_version", "last_batch_id", "last_position",
        "last_event_at", "quarantined", "parked"])
    if not held.num_rows:
        return {}
    held = held.filter(pc.is_in(held[key_column], pa.array(sorted({k for _, k in wanted}), pa.string())))
    codec = state_json.codec(projection.state)
    out = {}
    cols = [held[c].to_pylist() for c in ("tenant", key_column, "state", "events", "last_stream_id", "last_version",
                                          "last_batch_id", "last_position", "quarantined")]
    at = held["last_event_at"].cast(pa.int64()).to_pylist()
    for tenant, key, state, count, sid, version, batch, last_position, quarantined, last_at in zip(*cols, at,
                                                                                                  strict=True):
        if (tenant, key) in wanted:
            last = None if sid is None else (batch, last_position, sid, version)
            out[(tenant, key)] = _Row(codec.loads(state) if state else {}, count, last, last_at, state,
                                      json.loads(quarantined) if quarantined else None)
    return out


def _parked_rows(target: DeltaTable, path: str, table: Table) -> pa.Table:
    """The events every held key's row keeps waiting (`parked`), as `_KEYED_SCHEMA`'s rows: each update folds them
    again, with the key's new events, from its last good state (a retry with the code deployed)."""
    key_column = table.key[1]
    held = current.files(path, target).to_table(columns=["tenant", key_column, "parked"])
    held = held.filter(pc.is_valid(held["parked"]))
    rows = [{"tenant": tenant, "key": key, **e} for tenant, key, text in zip(
        held["tenant"].to_pylist(), held[key_column].to_pylist(), held["parked"].to_pylist(), strict=True)
        for e in json.loads(text)]
    return pa.Table.from_pylist(rows, schema=_KEYED_SCHEMA) if rows else _KEYED_SCHEMA.empty_table()


def _build(
    warehouse: Location, projection: Projection, domain: Domain, table: Table, turn: Turn, events_path: str,
    events: DeltaTable, frontier: int, read: int | None,
) -> Result:
    """Every key folded from `events` (at its version), the table overwritten: a first build, or a rebuild."""
    version = int(events.version())
    count = pieces.count_for(tables.files_bytes(events))
    if count == 1:
        keyed = _keyed(_whole(events_path, events, columns_of(domain), lambda part: _of_types(part, projection, domain)),
                       projection, domain)
        out, folded, without_key = _table_rows(projection, table, _fold(projection, domain, keyed, {})), keyed.count, \
            keyed.without_key
        failed = keyed.failed
    else:
        out, folded, without_key, failed = _build_in_pieces(projection, domain, table, events_path, events, count)
    path = table.path(warehouse)
    at = Position(table.app_id_over(str(events.metadata().id)), read).moved(version, cursor=version, frontier=frontier)
    position.fence_older(path, [(f"{table.app_id}.cursor", position.FENCE)])  # an older release: its cursor past `events`
    turn.confirm(path, at.app_id, read)
    if not tables.is_delta_table(path):
        DeltaTable.create(path, table.schema, mode="ignore", description=f"es_pipeline: {table.comment}")
    target = DeltaTable(path)
    if target.metadata().configuration.get(KIND) != table.properties[KIND]:  # before the rows: erase finds it
        target.alter.set_table_properties(table.properties, raise_if_not_exists=False)
    keyless = _dead_keys(table.name, failed)
    dead_letters.add(warehouse, table.name, keyless)  # first: a crash before the rows leaves them listed, not lost
    write_deltalake(path, out, mode="overwrite", schema_mode="overwrite",
                    commit_properties=at.commit())
    dead_letters.follow(warehouse, table.name, table.key[1], keyless=keyless)  # a whole build: these alone
    return result(table.name, out.num_rows, version, -1, folded, keys=out.num_rows, without_key=without_key,
                  frontier=frontier, out=out, keyless=keyless.num_rows)


def _dead_keys(name: str, failed: pa.Table | None) -> pa.Table:
    """`_dead_letters`' rows of the events whose key function failed (`_Keyed.failed`): no key."""
    if failed is None or not failed.num_rows:
        return dead_letters.COLUMNS.empty_table()
    said = [json.loads(e) for e in failed["key_error"].to_pylist()]
    n = failed.num_rows
    return pa.table({
        "table_name": pa.array([name] * n, pa.string()), "tenant": failed["tenant"], "key": pa.nulls(n, pa.string()),
        "stream_id": failed["stream_id"], "stream_type": failed["stream_type"],
        "version": failed["version"].cast(pa.int64()), "event_type": failed["event_type"],
        "error_kind": pa.array([e[0] for e in said], pa.string()), "message": pa.array([e[1] for e in said], pa.string()),
        "first_seen": pa.array([datetime.now(UTC)] * n, UTC_MICROS), "retries": pa.array([0] * n, pa.int32()),
    }).cast(dead_letters.COLUMNS)


def _build_in_pieces(projection: Projection, domain: Domain, table: Table, events_path: str, events: DeltaTable,
                     count: int) -> tuple[pa.Table, int, int, pa.Table | None]:
    """A build read in bounded pieces (lake/delta/pieces.py): a million events at a time keyed and sent to the piece
    of their key (by a hash of tenant and key, so a key's events meet in one piece), then each piece sorted and
    folded alone. (the table's rows, events folded, events without a key, those whose key function failed)"""
    without_key = 0
    failed: list[pa.Table] = []

    def keyed_parts() -> Iterator[pa.RecordBatch]:
        nonlocal without_key
        for rows in _parts(events_path, events, columns_of(domain), lambda part: _of_types(part, projection, domain)):
            base, _ = _key_rows(rows, projection, domain)  # the events parsed for their keys are parsed again
            failed.append(base.filter(pc.is_valid(base["key_error"])))
            base = base.drop_columns(["key_error"])
            has_key = pc.is_valid(base["key"])
            without_key += base.num_rows - int(pc.sum(has_key.cast(pa.int64())).as_py() or 0)
            yield from base.filter(has_key).cast(_KEYED_SCHEMA).to_batches()

    outs, folded = [], 0
    with pieces.spread(keyed_parts(), _KEYED_SCHEMA, count, _piece_of_key(count)) as parts:
        for i in range(parts.count):
            keyed = _ordered(parts.read(i), None, 0)
            folded += keyed.count
            if keyed.count:
                outs.append(_table_rows(projection, table, _fold(projection, domain, keyed, {})))
    out = pa.concat_tables(outs) if outs else _table_rows(projection, table, {})
    return out, folded, without_key, pa.concat_tables(failed) if failed else None


_KEYED_SCHEMA = pa.schema([("tenant", pa.string()), ("stream_id", pa.string()), ("stream_type", pa.string()),
                           ("version", pa.int32()), ("event_type", pa.string()), ("payload", pa.string()),
                           ("batch", pa.int64()), ("position", pa.int64()), ("at", pa.int64()), ("key", pa.string())])


def _piece_of_key(count: int) -> Callable[[pa.RecordBatch], pa.Array]:
    """Each row's piece by a hash of its (tenant, key): the same piece in every batch."""
    def piece_of(batch: pa.RecordBatch) -> pa.Array:
        pairs = pc.binary_join_element_wise(batch["tenant"], batch["key"], "\x00")
        seen = pc.unique(pairs)
        piece = pa.array([zlib.crc32(p.encode()) % count for p in seen.to_pylist()], pa.int64())
        return piece.take(pc.index_in(pairs, value_set=seen))
    return piece_of


def _increment(kind: CrossStream, new: pa.Table, increment: Increment) -> _Folded:
    """The rows of the commits after the cursor that are due now folded onto their keys' rows (module docstring)."""
    projection, domain, table, at = kind.projection, kind.domain, kind.table, increment.position
    assert at.read is not None and at.cursor is not None and at.frontier is not None
    seen, f_prev = at.read, at.frontier
    f_new = max(kind.frontier, f_prev)  # the frontier only moves up
    new = _of_types(new, projection, domain)
    batch = pc.fill_null(new["batch_id"].cast(pa.int64()), 0) if new.num_rows else pa.array([], pa.int64())
    commit = new["_commit_version"] if new.num_rows else pa.array([], pa.int64())
    # Seen before (up to `seen`): folded if below the old frontier; now due if below the new one.
    earlier = pc.less_equal(commit, seen)
    done = pc.and_(earlier, pc.less(batch, f_prev))
    waiting = pc.greater_equal(batch, f_new)
    due = new.filter(pc.invert(pc.or_(done, waiting)))
    left = new.filter(waiting)
    new_cursor = increment.now if not left.num_rows else int(pc.min(left["_commit_version"]).as_py()) - 1
    keyed = _keyed(due.drop_columns(["_commit_version"]), projection, domain)
    keyless = _dead_keys(table.name, keyed.failed)
    parked = _parked_rows(increment.target, increment.path, table)
    if parked.num_rows:  # every held key tried again, its waiting events with its new ones, in the lake's order
        keyed = _ordered(pa.concat_tables([keyed.rows.select(_KEYED_SCHEMA.names).cast(_KEYED_SCHEMA), parked]),
                         None, keyed.without_key)
    first = keyed.firsts()
    prior = _prior(increment.target, increment.path, table, set(first), projection) if first else {}
    # A key whose new events do not all sort after its last folded one is folded again, whole.
    late = {k for k, order in first.items() if k in prior and prior[k].last is not None and order <= prior[k].last}  # type: ignore[operator]
    folded = _fold(projection, domain, keyed if not late else keyed.only(late, keep=False), prior)
    if late:
        log.info("%s: %d keys fold again from events (an event sorts before their last folded one)", table.name, len(late))
        folded.update(_refold(projection, domain, EVENTS.path(increment.warehouse), increment.feed.table, late, left))
    return _Folded(kind, increment, _table_rows(projection, table, folded), keyed.count, len(late), left.num_rows,
                   keyed.without_key, new_cursor, f_new, keyless)


@dataclass(frozen=True)
class _Folded:
    """An increment of a cross-stream projection folded: its keys' rows merged with the position moved (the events
    still waiting stay after the new cursor)."""

    kind: CrossStream
    increment: Increment
    out: pa.Table
    events: int
    refolded: int
    waiting: int
    without_key: int
    cursor: int
    frontier: int
    keyless: pa.Table  # `_dead_letters`' rows of the events whose key function failed (under quarantine)

    def commit(self, txn: int) -> Result:
        step, table, target = self.increment, self.kind.table, self.increment.target
        at = step.position
        assert at.read is not None and at.cursor is not None
        done = lambda: result(table.name, current.row_count(target), step.now, step.previous, self.events,  # noqa: E731
                              keys=self.out.num_rows, refolded=self.refolded, waiting=self.waiting,
                              without_key=self.without_key, frontier=self.frontier, out=self.out,
                              keyless=self.keyless.num_rows)
        if not self.out.num_rows and self.cursor == at.cursor and self.frontier == at.frontier:
            return done()  # only waiting rows: nothing to record
        dead_letters.add(step.warehouse, table.name, self.keyless)  # before the commit that passes them by
        properties = at.moved(txn, cursor=self.cursor, frontier=self.frontier).commit()
        if self.out.num_rows:
            key = table.key[1]
            target.merge(self.out, predicate=f"t.tenant = u.tenant AND t.{key} = u.{key}", source_alias="u",
                         target_alias="t", commit_properties=properties).when_matched_update_all() \
                .when_not_matched_insert_all().execute()
        else:
            position.record(target, properties)
        target.update_incremental()
        dead_letters.follow(step.warehouse, table.name, table.key[1])
        return done()


def _refold(
    projection: Projection, domain: Domain, events_path: str, events: DeltaTable, keys: set[tuple[str, str]],
    waiting: pa.Table,
) -> dict[tuple[str, str], _Row]:
    """`keys` folded from all their events in `events` (at the version read) but the `waiting` ones (they are
    folded later)."""
    kept = []
    for rows in _parts(events_path, events, columns_of(domain), lambda part: _of_types(part, projection, domain)):
        if waiting.num_rows:  # a million events at a time: only the rows of `keys` are held
            held = tables.tenant_filled(waiting.select(tables.KEY)).cast(pa.schema([("tenant", pa.string()), (
                "stream_id", pa.string()), ("version", rows.schema.field("version").type)]))
            rows = tables.tenant_filled(rows).join(held, keys=tables.KEY, join_type="left anti")
        kept.append(_keyed(rows, projection, domain).only(keys).rows.drop_columns(["tcode", "kcode"]))
    if not kept:
        return {}
    return _fold(projection, domain, _ordered(pa.concat_tables(kept), None, 0), {})


# -- the Spark build -----------------------------------------------------------------------------------

_KEYED_DDL = ("tenant STRING, stream_id STRING, stream_type STRING, version INT, event_type STRING, payload STRING, "
              "batch BIGINT, position BIGINT, at BIGINT, key STRING, key_error STRING, error STRING")
_KEYED = ["tenant", "stream_id", "stream_type", "version", "event_type", "payload", "batch", "position", "at", "key"]
_OUT_ROWS = 5_000  # keys a Spark worker hands back at a time


def _fold_error(exc: ProjectionFoldError) -> str:
    return json.dumps([exc.projection, exc.key, exc.stream_id, exc.version, exc.event_type, exc.reason])


def _spark_keys(projection: Projection, domain: Domain) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """For `mapInArrow`: each `events` row of a partition keyed as the in-process build keys it (`_key_rows`); rows
    without a key left out; a key function's failure handed back as one row with `error`."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            try:
                keyed, _ = _key_rows(pa.Table.from_batches([batch]), projection, domain)
            except ProjectionFoldError as exc:
                yield pa.RecordBatch.from_pylist([{"error": _fold_error(exc)}], schema=_keyed_schema())
                return
            keyed = keyed.filter(pc.or_(pc.is_valid(keyed["key"]), pc.is_valid(keyed["key_error"]))) \
                .select([*_KEYED, "key_error"])
            yield from keyed.append_column("error", pa.nulls(keyed.num_rows, pa.string())) \
                .cast(_keyed_schema()).to_batches()

    return run


def _keyed_schema() -> pa.Schema:
    return pa.schema([("tenant", pa.string()), ("stream_id", pa.string()), ("stream_type", pa.string()),
                      ("version", pa.int32()), ("event_type", pa.string()), ("payload", pa.string()),
                      ("batch", pa.int64()), ("position", pa.int64()), ("at", pa.int64()), ("key", pa.string()),
                      ("key_error", pa.string()), ("error", pa.string())])


def _spark_fold(projection: Projection, domain: Domain,
                table: Table) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """For `mapInArrow`: a partition's keyed events, sorted by tenant, key and the lake's order, folded key by key
    as the in-process fold does (`_fold_span`), handed back as the table's rows; a failure as one row with
    `error`."""
    out_schema = table.schema.append(pa.field("error", pa.string()))

    def rows_of(done: dict[tuple[str, str], _Row]) -> pa.Table:
        rows = _table_rows(projection, table, done)
        return rows.append_column("error", pa.nulls(rows.num_rows, pa.string()))

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        done: dict[tuple[str, str], _Row] = {}
        current: tuple[str, str] | None = None
        taken: list[_Taken] = []
        try:
            for batch in batches:
                errors = pc.drop_null(batch.column("error"))
                if len(errors):
                    yield pa.RecordBatch.from_pylist([{"error": errors[0].as_py()}], schema=out_schema)
                    return
                tenant, key, sid, stype, etype, payload = (batch.column(c).to_pylist() for c in (
                    "tenant", "key", "stream_id", "stream_type", "event_type", "payload"))
                version, order, position, at = (batch.column(c).to_pylist() for c in (
                    "version", "batch", "position", "at"))
                for i in range(batch.num_rows):
                    k = (tenant[i], key[i])
                    if k != current:
                        if current is not None:
                            done[current] = _fold_key(projection, domain, current, _Row({}, 0, None, None), taken)
                            if len(done) >= _OUT_ROWS:
                                yield from rows_of(done).to_batches()
                                done = {}
                        current, taken = k, []
                    taken.append((sid[i], stype[i], version[i], etype[i], payload[i], order[i], position[i], at[i],
                                  None))
            if current is not None:
                done[current] = _fold_key(projection, domain, current, _Row({}, 0, None, None), taken)
            if done:
                yield from rows_of(done).to_batches()
        except ProjectionFoldError as exc:
            yield pa.RecordBatch.from_pylist([{"error": _fold_error(exc)}], schema=out_schema)

    return run


def _build_with_spark(
    spark: SparkSession, warehouse: Location, projection: Projection, domain: Domain, table: Table, turn: Turn,
    events_path: str, events: DeltaTable, frontier: int, read: int | None,
) -> Result:
    """`_build` on Spark: the events of the projection's types keyed and folded on the executors (`mapInArrow`,
    partitioned by tenant and key, sorted in the lake's order), the rows written as Parquet by Spark and committed
    by delta-rs over the table, with the same three transaction ids, in the table's turn (the lake's commit rule,
    docs/decisions/0024-object-storage-and-cluster.md): an in-process increment goes on from it."""
    from pyspark.sql import functions as F

    version = int(events.version())
    df = tables.read(spark, events_path, version=version)
    wanted = set(projection.event_types)
    kinds = [r[0] for r in df.select("event_type").distinct().collect()
             if r[0] is not None and domain.base_type(r[0]) in wanted]
    held = set(df.columns)
    columns = [F.col(c) if c in held else F.lit(None).cast("bigint" if c in ("batch_id", "global_position")
                                                             else "string").alias(c) for c in columns_of(domain)]
    source = df.where(F.col("event_type").isin(kinds)).select(*columns)
    keyed = source.mapInArrow(_spark_keys(projection, domain), _KEYED_DDL).cache()
    failed_rows = keyed.where(F.col("key_error").isNotNull()).select(
        "tenant", "stream_id", "stream_type", "version", "event_type", "key_error").collect()
    failed = pa.Table.from_pylist([r.asDict() for r in failed_rows], schema=pa.schema([
        ("tenant", pa.string()), ("stream_id", pa.string()), ("stream_type", pa.string()), ("version", pa.int32()),
        ("event_type", pa.string()), ("key_error", pa.string())]))
    folded = (keyed.where(F.col("key").isNotNull() | F.col("error").isNotNull()).drop("key_error")
              .repartition("tenant", "key")
              .sortWithinPartitions("tenant", "key", *ORDER)
              .mapInArrow(_spark_fold(projection, domain, table), f"{table.ddl}, error STRING")
              .cache())
    try:
        stats = folded.agg(F.count("tenant").alias("rows"), F.sum("events").alias("events"),
                           F.min("error").alias("error"),
                           F.sum(F.when(F.col("quarantined").isNotNull(), 1).otherwise(0)).alias("held")).first()
        if stats["error"] is not None:
            raise ProjectionFoldError(*json.loads(stats["error"]))
        rows, folded_events = int(stats["rows"] or 0), int(stats["events"] or 0)
        without_key = source.count() - keyed.where(F.col("key").isNotNull()).count()  # none, or its function failed
        path = table.path(warehouse)
        at = Position(table.app_id_over(str(events.metadata().id)), read)
        position.fence_older(path, [(f"{table.app_id}.cursor", position.FENCE)])
        turn.confirm(path, at.app_id, read)
        if not tables.is_delta_table(path):
            DeltaTable.create(path, table.schema, mode="ignore", description=f"es_pipeline: {table.comment}")
        target = DeltaTable(path)
        if target.metadata().configuration.get(KIND) != table.properties[KIND]:  # before the rows: erase finds it
            target.alter.set_table_properties(table.properties, raise_if_not_exists=False)
        folder = arrow_append.new_folder("spark-build")
        spark.conf.set("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")  # as delta-rs writes them
        (folded.where(F.col("error").isNull()).drop("error").write.mode("error").option("compression", "snappy")
         .parquet(f"{path}/{folder}"))
        ids = at.moved(version, cursor=version, frontier=frontier).ids
        keyless = _dead_keys(table.name, failed)
        dead_letters.add(warehouse, table.name, keyless)  # first: a crash before the rows leaves them listed
        arrow_append.commit_parquet_folder(path, table.schema, folder, app_id=ids[0], version=version,
                                           expect_rows=rows, overwrite=True,
                                           also=[(ids[1], version), (ids[2], frontier)])
        dead_letters.follow(warehouse, table.name, table.key[1], keyless=keyless)
    finally:
        folded.unpersist()
        keyed.unpersist()
    done = result(table.name, rows, version, -1, folded_events, keys=rows, without_key=without_key, frontier=frontier,
                  engine="spark", keyless=failed.num_rows)
    return done.with_figures(keys_quarantined=int(stats["held"] or 0))
