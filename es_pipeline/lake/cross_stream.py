"""Cross-stream projections: a team's fold of chosen event types from every stream, grouped by a key read from
the payload (a customer id, an account id), one row per (tenant, key), kept incrementally and exactly once.

A team declares one in its package (`Domain.projection`, docs/domain.md); its table is an instance of `Table`
named after it. What a row holds is the fold of its key's events in **the lake's order**: `(batch_id,
global_position, stream_id, version)`, the extraction batch that brought the event, then the store's position
within it. That order is a property of the rows themselves, so an increment and a rebuild fold the same events
in the same order and agree (docs/decisions.md, "Cross-stream order").

Batches reach the lake out of their id order (ranges extract concurrently). A batch is folded once no batch of a
lower id can still come: the frontier F, the lowest batch id the store's offsets still hold pending (or the next
one it will give), read before the lake. Events of batches at or above F wait, in `events`, for the next update.
Three numbers, each a Delta transaction id of the table committed with its rows, say what is folded:

- `es_pipeline.<name>`: the `events` version read up to (V);
- `es_pipeline.<name>.cursor`: every row of the `events` commits up to it is folded (C <= V);
- `es_pipeline.<name>.frontier`: of the commits after C up to V, the rows of batches below it are (F).

An update reads `events`' change feed after C, folds what is new below the new frontier onto each key's state,
and commits the three with the rows. An event that still sorts before its key's last folded one (a catch-up of a
restored store, batch 0; a batch whose id was reused) makes that key fold again from all its events in `events`:
slower, never wrong. A first build, a changed definition or revision, a feed that cannot be read (vacuumed, or
larger than `feed.SMALL_INCREMENT`), or a tenant's erasure (it records frontier 0) folds every key from `events`.

No JVM: the fold is plain Python per event, as reducers are (lake/fold.py); the table is written by delta-rs.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, QueryBuilder, Transaction, write_deltalake

from es_pipeline.domain import Domain, Event, Projection
from es_pipeline.errors import ProjectionFoldError
from es_pipeline.lake import feed, tables, typed_state
from es_pipeline.lake.feed import Feed
from es_pipeline.lake.fold import with_schema_versions
from es_pipeline.lake.serial import Turn, one_at_a_time
from es_pipeline.lake.table import Table
from es_pipeline.lake.tables import Location
from es_pipeline.source import payloads

log = logging.getLogger(__name__)

_AT = pa.timestamp("us", tz="UTC")
KIND = "es_pipeline.cross_stream"  # the table property that marks a cross-stream projection (its definition)
# The `events` columns a projection reads (the change feed's commit version besides, on an increment).
COLUMNS = ["tenant", "stream_id", "stream_type", "version", "event_type", "payload", "payload_encoding",
           "recorded_at", "batch_id", "global_position"]
NO_FRONTIER = 1 << 62  # without a store to ask: every batch the lake holds is folded (late ones fold their key again)

Frontier = Callable[[], int]


def columns_of(domain: Domain) -> list[str]:
    """The `events` columns a projection of `domain` reads: `COLUMNS`, and `metadata` if versions are read there."""
    return [*COLUMNS, "metadata"] if domain.metadata_field is not None else list(COLUMNS)


def table_of(projection: Projection) -> Table:
    """The projection's table: tenant and key, the state as JSON, what was folded last, then the declared fields."""
    schema = pa.schema([
        ("tenant", pa.string()), (projection.key_column, pa.string()), ("state", pa.string()),
        ("events", pa.int64()), ("last_stream_id", pa.string()), ("last_version", pa.int32()),
        ("last_batch_id", pa.int64()), ("last_position", pa.int64()), ("last_event_at", _AT),
        ("revision", pa.int32()), ("updated_at", _AT), *(projection.state or []),
    ])
    return Table(projection.name, schema, key=("tenant", projection.key_column),
                 comment=f"cross-stream projection {projection.name} ({projection.domain}): "
                         f"{', '.join(projection.event_types)} by {projection.key_column}",
                 properties={KIND: projection.definition})


def table_names(warehouse: Location) -> list[str]:
    """The cross-stream projection tables in the lake now (whatever the domain), by name."""
    known = set(tables.TABLES)
    names = [n for n in tables.table_names(warehouse, "") if n not in known and not n.startswith(typed_state.PREFIX)]
    return [n for n in names if KIND in DeltaTable(tables.table_path(warehouse, n)).metadata().configuration]


@dataclass(frozen=True)
class CrossStreamResult:
    rows: int  # rows of the table after the run
    events_version: int  # the `events` version read
    previous_events_version: int  # -1: built whole
    events_folded: int
    keys_updated: int
    keys_refolded: int  # keys folded again from `events` (an event that sorts before their last one)
    events_waiting: int  # events of batches at or above the frontier: folded by a later update
    events_without_key: int  # events of the projection's types whose key is missing (skipped)
    frontier: int


def update(
    warehouse: Location, domain: Domain, name: str, *, store_dsn: str | None = None,
    frontier: Frontier | None = None,
) -> CrossStreamResult:
    """Bring projection `name` of `domain` up to `events` now (module docstring), one update at a time with
    `store_dsn`. `frontier`: the lowest batch id that may still reach the lake (`extraction.offsets.batch_frontier`);
    None: every batch the lake holds is final."""
    with one_at_a_time(store_dsn, name) as turn:
        result = increment(warehouse, domain.projections[name], domain, turn, frontier)
        assert result is not None
        return result


def increment(
    warehouse: Location, projection: Projection, domain: Domain, turn: Turn, frontier: Frontier | None,
    events_feed: Feed | None = None, *, build: bool = True,
) -> CrossStreamResult | None:
    """One update in the table's `turn`; None: no `events` table yet, or a whole build that `build` forbids.
    `events_feed`: `events`' change feed shared with other increments (a tailing run's)."""
    events_path = tables.table_path(warehouse, "events")
    if not tables.is_delta_table(events_path):
        return None
    table = table_of(projection)
    path = table.path(warehouse)
    # The frontier first, then the lake: a batch below it is in every version of `events` read after.
    f_new = NO_FRONTIER if frontier is None else frontier()
    target = DeltaTable(path) if tables.is_delta_table(path) else None
    seen = cursor = f_prev = None
    if target is not None and tables.has_columns(target, table.schema.names):
        seen, cursor, f_prev = (target.transaction_version(a) for a in app_ids(projection.name, projection.definition))
    columns = columns_of(domain)
    events_feed = events_feed or Feed(events_path, columns)
    now = events_feed.version
    new = None
    if seen is not None and cursor is not None and f_prev and seen <= now:
        f_new = max(f_new, int(f_prev))
        if cursor >= now:  # nothing new, nothing waiting
            return CrossStreamResult(feed.row_count(target), now, int(seen), 0, 0, 0, 0, 0, int(f_prev))  # type: ignore[arg-type]
        new = events_feed.rows(int(cursor), [*columns, "_commit_version"])
    if new is None:
        if not build:
            return None
        return _build(warehouse, projection, domain, table, turn, events_path, f_new, read=seen)
    assert target is not None
    return _increment(warehouse, projection, domain, table, turn, target, new, events_path,
                      int(seen), int(cursor), int(f_prev), f_new, now)  # type: ignore[arg-type]


def mark_for_rebuild(warehouse: Location, name: str) -> None:
    """After a tenant's erasure: the projection's next update folds every key from `events` again (frontier 0), so
    that none of the erased events waiting in `events`' change feed comes back."""
    target = DeltaTable(tables.table_path(warehouse, name))
    definition = target.metadata().configuration.get(KIND)
    if definition is not None:
        target.create_write_transaction([], mode="append", schema=target.schema(), commit_properties=CommitProperties(
            app_transactions=[Transaction(app_ids(name, definition)[2], 0)]))


def app_ids(name: str, definition: str) -> tuple[str, str, str]:
    """The Delta app ids of the three numbers (module docstring), of this definition: a changed one finds none
    and builds whole (so the table property `KIND`, set before the rows, never vouches for rows of another)."""
    tag = hashlib.sha256(definition.encode()).hexdigest()[:12]
    seen = f"es_pipeline.{name}.{tag}"
    return seen, f"{seen}.cursor", f"{seen}.frontier"


def _commit(projection: Projection, seen: int, cursor: int, frontier: int) -> CommitProperties:
    return CommitProperties(app_transactions=[Transaction(a, v) for a, v in zip(
        app_ids(projection.name, projection.definition), (seen, cursor, frontier), strict=True)])


# -- reading and ordering events -----------------------------------------------------------------------


@dataclass
class _Keyed:
    """The events of one read with their keys, in the lake's order: parsed once, folded from here."""

    tenant: list[str]
    key: list[str]
    order: list[tuple[int, int, str, int]]  # (batch_id, global_position, stream_id, version)
    events: list[Event]
    recorded_at: list[int | None]
    without_key: int


def _of_types(rows: pa.Table, projection: Projection, domain: Domain) -> pa.Table:
    """The rows of the projection's event types (any version suffix, where versions are read from there)."""
    if not rows.num_rows:
        return rows
    wanted = set(projection.event_types)
    held = [t for t in pc.unique(rows["event_type"]).to_pylist() if t is not None and domain.base_type(t) in wanted]
    return rows.filter(pc.is_in(rows["event_type"], pa.array(held, pa.string())))


def _keyed(rows: pa.Table, projection: Projection, domain: Domain) -> _Keyed:
    """Each row upcast and keyed (a row without a key is counted and left out), sorted by tenant, key, order."""
    rows = with_schema_versions(payloads.for_reducers(tables.tenant_filled(rows)), domain)
    n = rows.num_rows
    tenant, sid, stype = (rows[c].to_pylist() for c in ("tenant", "stream_id", "stream_type"))
    version, etype, payload = (rows[c].to_pylist() for c in ("version", "event_type", "payload"))
    batch = pc.fill_null(rows["batch_id"].cast(pa.int64()), 0).to_pylist()
    position = pc.fill_null(rows["global_position"].cast(pa.int64()), -1).to_pylist()
    at = rows["recorded_at"].cast(_AT).cast(pa.int64()).to_pylist()
    key_of, upcast = projection.key_of, domain.upcast
    keys: list[str | None] = [None] * n
    events: list[Event | None] = [None] * n
    for i in range(n):
        try:
            data = orjson.loads(payload[i])
        except orjson.JSONDecodeError:
            data = json.loads(payload[i])
        event = upcast(stype[i], Event(sid[i], version[i], etype[i], data))
        try:
            k = key_of(event)
        except Exception as exc:  # noqa: BLE001 - a key function's failure is reported with its place
            raise ProjectionFoldError(projection.name, None, sid[i], version[i], etype[i],
                                      f"its key: {type(exc).__name__}: {exc}") from None
        if k is not None:
            keys[i], events[i] = str(k), event
    kept = [i for i in range(n) if keys[i] is not None]
    kept.sort(key=lambda i: (tenant[i], keys[i], batch[i], position[i], sid[i], version[i]))
    return _Keyed([tenant[i] for i in kept], [keys[i] for i in kept],  # type: ignore[misc]
                  [(batch[i], position[i], sid[i], version[i]) for i in kept],
                  [events[i] for i in kept], [at[i] for i in kept], n - len(kept))  # type: ignore[misc]


def _whole(events_path: str, wanted: list[str], rows_of: Callable[[pa.Table], pa.Table]) -> pa.Table:
    """The `events` table's rows now (the `wanted` columns it has), each batch of files filtered by `rows_of`."""
    events = DeltaTable(events_path)
    held = set(events.schema().to_arrow().names)
    columns = [c for c in wanted if c in held]
    if feed.has_deletion_vectors(events):  # its files alone are not its rows: DataFusion applies the vectors
        reader = QueryBuilder().register("events", events).execute(
            "SELECT " + ", ".join(f'"{c}"' for c in columns) + " FROM events")
        parts: Iterator[pa.RecordBatch] = iter(reader)
    else:
        parts = feed.files(events_path, events).to_batches(columns=columns)
    out = [rows_of(feed.plain(pa.Table.from_batches([b]))) for b in parts]
    rows = pa.concat_tables(out) if out else pa.table({c: pa.array([], pa.string()) for c in columns})
    for c in wanted:
        if c not in rows.column_names:
            rows = rows.append_column(c, pa.nulls(rows.num_rows, pa.int64() if c in ("batch_id", "global_position")
                                                   else pa.string()))
    return rows


# -- folding -----------------------------------------------------------------------------------------


@dataclass
class _Row:
    state: dict
    events: int
    last: tuple[int, int, str, int] | None
    last_at: int | None


def _fold(projection: Projection, keyed: _Keyed, prior: dict[tuple[str, str], _Row]) -> dict[tuple[str, str], _Row]:
    """Each key's events of `keyed` folded onto its `prior` row (or from nothing), in order."""
    fold, out = projection.fold, {}
    i, n = 0, len(keyed.key)
    while i < n:
        k = (keyed.tenant[i], keyed.key[i])
        row = prior.get(k) or _Row({}, 0, None, None)
        state, count, last, last_at = row.state, row.events, row.last, row.last_at
        while i < n and keyed.key[i] == k[1] and keyed.tenant[i] == k[0]:
            event = keyed.events[i]
            try:
                state = fold(state, event)
            except Exception as exc:  # noqa: BLE001 - any fold failure is reported, with its place
                reason = f"the payload has no field {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
                raise ProjectionFoldError(projection.name, k[1], event.stream_id, event.version, event.event_type,
                                          reason) from None
            count, last, last_at = count + 1, keyed.order[i], keyed.recorded_at[i]
            i += 1
        out[k] = _Row(state, count, last, last_at)
    return out


def _table_rows(projection: Projection, table: Table, folded: dict[tuple[str, str], _Row]) -> pa.Table:
    """Folded rows in the table's schema, stamped now; the declared fields from the state."""
    keys = sorted(folded)
    rows = [folded[k] for k in keys]
    states = [r.state for r in rows]
    n = len(rows)
    columns: list[pa.Array] = [
        pa.array([k[0] for k in keys], pa.string()), pa.array([k[1] for k in keys], pa.string()),
        pa.array([json.dumps(s, sort_keys=True, separators=(",", ":")) for s in states], pa.string()),
        pa.array([r.events for r in rows], pa.int64()),
        pa.array([r.last[2] if r.last else None for r in rows], pa.string()),
        pa.array([r.last[3] if r.last else None for r in rows], pa.int32()),
        pa.array([r.last[0] if r.last else None for r in rows], pa.int64()),
        pa.array([r.last[1] if r.last else None for r in rows], pa.int64()),
        pa.array([r.last_at for r in rows], pa.int64()).cast(_AT),
        pa.array([projection.revision] * n, pa.int32()), pa.array([datetime.now(UTC)] * n, _AT),
    ]
    if projection.state is not None:
        try:
            fields = typed_state.state_fields(states, projection.state)
        except typed_state.StateMisfit as misfit:
            raise ProjectionFoldError(projection.name, keys[misfit.index][1], None, None, None,
                                      f"its state does not fit the declared fields: field {misfit.field!r} holds "
                                      f"{misfit.value!r} ({misfit.reason})") from None
        columns.extend(fields.columns)
    return pa.Table.from_arrays(columns, schema=table.schema)


def _prior(target: DeltaTable, path: str, table: Table, wanted: set[tuple[str, str]]) -> dict[tuple[str, str], _Row]:
    """The table's rows of the `wanted` keys, as the fold goes on from them."""
    key_column = table.key[1]
    held = feed.files(path, target).to_table(columns=[
        "tenant", key_column, "state", "events", "last_stream_id", "last_version", "last_batch_id", "last_position",
        "last_event_at"])
    if not held.num_rows:
        return {}
    held = held.filter(pc.is_in(held[key_column], pa.array(sorted({k for _, k in wanted}), pa.string())))
    out = {}
    cols = [held[c].to_pylist() for c in ("tenant", key_column, "state", "events", "last_stream_id", "last_version",
                                          "last_batch_id", "last_position")]
    at = held["last_event_at"].cast(pa.int64()).to_pylist()
    for tenant, key, state, count, sid, version, batch, position, last_at in zip(*cols, at, strict=True):
        if (tenant, key) in wanted:
            last = None if sid is None else (batch, position, sid, version)
            out[(tenant, key)] = _Row(orjson.loads(state) if state else {}, count, last, last_at)
    return out


def _build(
    warehouse: Location, projection: Projection, domain: Domain, table: Table, turn: Turn, events_path: str,
    frontier: int, read: int | None,
) -> CrossStreamResult:
    """Every key folded from `events` now, the table overwritten: a first build, or a rebuild."""
    version = int(DeltaTable(events_path).version())
    rows = _whole(events_path, columns_of(domain), lambda part: _of_types(part, projection, domain))
    keyed = _keyed(rows, projection, domain)
    out = _table_rows(projection, table, _fold(projection, keyed, {}))
    path = table.path(warehouse)
    seen_id = app_ids(projection.name, projection.definition)[0]
    turn.confirm(path, seen_id, read)
    if not tables.is_delta_table(path):
        DeltaTable.create(path, table.schema, mode="ignore", description=f"es_pipeline: {table.comment}")
    target = DeltaTable(path)
    if target.metadata().configuration.get(KIND) != projection.definition:  # before the rows: erase finds it
        target.alter.set_table_properties(table.properties, raise_if_not_exists=False)
    write_deltalake(path, out, mode="overwrite", schema_mode="overwrite",
                    commit_properties=_commit(projection, version, version, frontier))
    return CrossStreamResult(out.num_rows, version, -1, len(keyed.key), out.num_rows, 0, 0, keyed.without_key, frontier)


def _increment(
    warehouse: Location, projection: Projection, domain: Domain, table: Table, turn: Turn, target: DeltaTable,
    new: pa.Table, events_path: str, seen: int, cursor: int, f_prev: int, f_new: int, now: int,
) -> CrossStreamResult:
    """The rows of the commits after the cursor that are due now folded onto their keys' rows (module docstring)."""
    new = _of_types(new, projection, domain)
    batch = pc.fill_null(new["batch_id"].cast(pa.int64()), 0) if new.num_rows else pa.array([], pa.int64())
    commit = new["_commit_version"] if new.num_rows else pa.array([], pa.int64())
    # Seen before (up to `seen`): folded if below the old frontier; now due if below the new one.
    earlier = pc.less_equal(commit, seen)
    done = pc.and_(earlier, pc.less(batch, f_prev))
    waiting = pc.greater_equal(batch, f_new)
    due = new.filter(pc.invert(pc.or_(done, waiting)))
    left = new.filter(waiting)
    new_cursor = now if not left.num_rows else int(pc.min(left["_commit_version"]).as_py()) - 1
    keyed = _keyed(due.drop_columns(["_commit_version"]), projection, domain)
    path = table.path(warehouse)
    wanted = set(zip(keyed.tenant, keyed.key, strict=True))
    prior = _prior(target, path, table, wanted) if wanted else {}
    # A key whose new events do not all sort after its last folded one is folded again, whole.
    first: dict[tuple[str, str], tuple[int, int, str, int]] = {}
    for tenant, key, order in zip(keyed.tenant, keyed.key, keyed.order, strict=True):
        first.setdefault((tenant, key), order)
    late = {k for k, order in first.items() if k in prior and prior[k].last is not None and order <= prior[k].last}  # type: ignore[operator]
    folded = _fold(projection, keyed, prior) if not late else _fold(projection, _without(keyed, late), prior)
    if late:
        log.info("%s: %d keys fold again from events (an event sorts before their last folded one)", table.name, len(late))
        folded.update(_refold(projection, domain, events_path, late, left))
    out = _table_rows(projection, table, folded)
    turn.confirm(path, app_ids(projection.name, projection.definition)[0], seen)
    props = _commit(projection, now, new_cursor, f_new)
    if out.num_rows:
        target.merge(out, predicate=f"t.tenant = u.tenant AND t.{table.key[1]} = u.{table.key[1]}", source_alias="u",
                     target_alias="t", commit_properties=props).when_matched_update_all() \
            .when_not_matched_insert_all().execute()
    else:
        target.create_write_transaction([], mode="append", schema=target.schema(), commit_properties=props)
    target.update_incremental()
    return CrossStreamResult(feed.row_count(target), now, seen, len(keyed.key), out.num_rows, len(late),
                             left.num_rows, keyed.without_key, f_new)


def _without(keyed: _Keyed, keys: set[tuple[str, str]]) -> _Keyed:
    kept = [i for i in range(len(keyed.key)) if (keyed.tenant[i], keyed.key[i]) not in keys]
    return _Keyed([keyed.tenant[i] for i in kept], [keyed.key[i] for i in kept], [keyed.order[i] for i in kept],
                  [keyed.events[i] for i in kept], [keyed.recorded_at[i] for i in kept], keyed.without_key)


def _refold(
    projection: Projection, domain: Domain, events_path: str, keys: set[tuple[str, str]], waiting: pa.Table
) -> dict[tuple[str, str], _Row]:
    """`keys` folded from all their events in `events` now but the `waiting` ones (they are folded later)."""
    rows = _whole(events_path, columns_of(domain), lambda part: _of_types(part, projection, domain))
    if waiting.num_rows:
        held = tables.tenant_filled(waiting.select(tables.KEY)).cast(pa.schema([("tenant", pa.string()), (
            "stream_id", pa.string()), ("version", rows.schema.field("version").type)]))
        rows = tables.tenant_filled(rows).join(held, keys=tables.KEY, join_type="left anti")
    keyed = _keyed(rows, projection, domain)
    others = {(t, k) for t, k in zip(keyed.tenant, keyed.key, strict=True)} - keys
    return _fold(projection, _without(keyed, others), {})
