"""Typed event tables: one Delta table per event type, a column per payload field, kept without the team's code.

`events` holds each payload as JSON text. For every event type in it, es_pipeline keeps `events_<type>`
(`ItemAdded` → `events_item_added`): the envelope (tenant, stream id and type, version, event type, recorded
time, event date, tx id, global position), `_overflow`, then one column per payload field, typed by the rule of
lake/shapes.py and widened as payloads change. Where the domain registered upcasters, the table holds each
payload as upcast, under the type the folds see (`ItemAdded.v2` goes to `events_item_added`).

**The mapping table** `event_tables` says which table holds which type, and each column's history: one row
per (event type, column, type it took), with the time of the first event that brought it and the `events`
version it came in with; a widened column gets a row for its new type.

**Exactly once.** Each update reads `events`' change data feed after the version `event_tables` records
(its Delta transaction id: the cursor), groups the new rows by type and appends each group to its table,
committing with the table's own transaction id the `events` version read. A table whose id is already there
is skipped, or takes only the rows of later commits: a replay after a crash adds nothing twice. The cursor is
committed last. A first build, a definition that changed (the rule's revision, the upcasters, the way schema
versions are read), an `events` table made anew, or a change feed that cannot be read (vacuumed, or purged by
a tenant's erasure) rebuilds every table from `events`' current rows.

**Widening** a column rewrites its table once (its rows read back, the column converted, all written in one
commit): readers then need no Delta type-widening support. A new column is added by schema evolution, no
rewrite. Hundreds of types stay cheap: an update touches the tables of the types it saw, each loaded once per
process and brought up to date incrementally.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
from deltalake import CommitProperties, DeltaTable, QueryBuilder, Transaction, write_deltalake

from es_pipeline.domain import Domain, Event
from es_pipeline.lake import feed, shapes, tables
from es_pipeline.lake.serial import one_at_a_time
from es_pipeline.lake.table import Table
from es_pipeline.lake.tables import Location

log = logging.getLogger(__name__)

PREFIX = "events_"
NAME = "event_tables"  # the mapping table
REVISION = 1  # of the rule in lake/shapes.py and of this layout: a change rebuilds every typed event table
CHUNK = 1_000_000  # events per step of a build
WRITERS = 4  # tables an increment writes at once
WINDOW = 4  # `events` commits an increment reads at once (an extraction commits up to 500,000 events in one)
_AT = pa.timestamp("us", tz="UTC")

ENVELOPE = pa.schema([
    ("tenant", pa.string()), ("stream_id", pa.string()), ("stream_type", pa.string()), ("version", pa.int32()),
    ("event_type", pa.string()), ("recorded_at", _AT), ("event_date", pa.date32()), ("tx_id", pa.int64()),
    ("global_position", pa.int64()), (shapes.OVERFLOW, pa.string()),
])
_ENVELOPE_NAMES = frozenset(n.lower() for n in ENVELOPE.names)
_READ = ["tenant", "stream_id", "stream_type", "version", "event_type", "recorded_at", "event_date", "tx_id",
         "global_position", "payload", "payload_encoding"]

MAPPING = Table(NAME, pa.schema([
    ("event_type", pa.string()), ("table_name", pa.string()), ("column_name", pa.string()), ("data_type", pa.string()),
    ("change", pa.string()), ("first_event_at", _AT), ("events_version", pa.int64()),
]), key=("event_type", "column_name", "data_type"), comment="which typed event table holds which event type; each column's history")


@dataclass
class EventTablesResult:
    """What an update did: the `events` version it brought every typed table to, and per table what it wrote."""

    events_version: int | None
    rebuilt: bool = False
    rows: dict[str, int] = field(default_factory=dict)  # table → rows written
    new_tables: list[str] = field(default_factory=list)
    new_columns: list[str] = field(default_factory=list)  # "table.column type"
    widened: list[str] = field(default_factory=list)  # "table.column: old → new"
    overflow: dict[str, int] = field(default_factory=dict)  # table → values kept in `_overflow`
    seconds: float = 0.0

    @property
    def events(self) -> int:
        return sum(self.rows.values())

    def add(self, later: EventTablesResult) -> EventTablesResult:
        """This update's figures followed by `later`'s (an update made of several windows)."""
        rows = dict(self.rows)
        for name, n in later.rows.items():
            rows[name] = rows.get(name, 0) + n
        overflow = dict(self.overflow)
        for name, n in later.overflow.items():
            overflow[name] = overflow.get(name, 0) + n
        return EventTablesResult(later.events_version, self.rebuilt or later.rebuilt, rows,
                                 [*self.new_tables, *later.new_tables], [*self.new_columns, *later.new_columns],
                                 [*self.widened, *later.widened], overflow)


def table_name(event_type: str) -> str:
    """`events_<type>`: camel case split by `_`, lowercased, each run of other characters than letters and digits
    one `_` (`ItemAdded`, `item-added` and `item.added` all give `events_item_added`); long names end in a hash."""
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", event_type)
    name = re.sub(r"[^a-z0-9]+", "_", snake.lower()).strip("_") or "_"
    if len(name) > 80:
        name = f"{name[:70]}_{_digest(event_type, 8)}"
    return PREFIX + name


def table_names(warehouse: Location) -> list[str]:
    """The typed event tables in the lake now, by name: the mapping table, then the tables it lists (another
    Delta table whose name begins with `events_` is not es_pipeline's, and is left alone)."""
    path = tables.table_path(warehouse, NAME)
    if not tables.is_delta_table(path):
        return []
    listed = DeltaTable(path).to_pyarrow_table(columns=["table_name"])["table_name"].to_pylist()
    return [NAME, *(n for n in sorted(set(listed)) if tables.is_delta_table(tables.table_path(warehouse, n)))]


def definition_of(domain: Domain) -> str:
    """What the tables' content depends on besides `events`: the rule's revision, the upcasters, where versions are
    read, the declared payload schemas."""
    upcasters = sorted(f"{u.event_type}@{u.version}:{getattr(u.upcast, '__qualname__', '?')}:{u.stream_types}"
                       for u in domain.upcasters.values())
    declared = {t: s.to_string() for t, s in sorted(domain.event_schemas.items())}
    return orjson.dumps({"revision": REVISION, "upcasters": upcasters, "versions": domain.schema_version,
                         "declared": declared}).decode()


APP_ID = "es_pipeline.event_tables"  # the Delta transaction id of every typed table, and of the mapping (the cursor)
BUILT_FOR = "es_pipeline.event_tables.built_for"  # the mapping's property: what its last whole build was for
OWNER = "es_pipeline.event_table"  # a typed table's property: the event type it holds (only such tables are touched)


def build_key(events_id: str, definition: str) -> str:
    """What a build is valid for: the `events` table and the definition. The mapping records it once a build has
    finished (and clears it as one starts): any other value means the tables are built anew, so that a changed
    definition, or one changed back, never appends to tables built under another."""
    return _digest(events_id + definition, 16)


def _digest(text: str, n: int) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:n]


def update(warehouse: Location, domain: Domain, *, store_dsn: str | None = None,
           progress: Callable[[str], None] | None = None) -> EventTablesResult:
    """Bring every typed event table up to `events` now, in the `event_tables` turn (lake/serial.py)."""
    with one_at_a_time(store_dsn, NAME):
        result = increment(warehouse, domain, progress=progress)
    assert result is not None
    return result


def increment(warehouse: Location, domain: Domain, *, build: bool = True,
              progress: Callable[[str], None] | None = None) -> EventTablesResult | None:
    """`update`'s work, the caller holding the turn; without `build`, None where the tables would be built anew
    (a tailing run leaves that to the asset's own run)."""
    started = time.monotonic()
    events_path = tables.table_path(warehouse, "events")
    if not tables.is_delta_table(events_path):
        return EventTablesResult(None)
    events = DeltaTable(events_path)
    now = int(events.version())
    key = build_key(tables.table_id(events_path), definition_of(domain))
    keeper = _Keeper(warehouse, domain, key, now)
    cursor = keeper.cursor()
    if cursor is not None and cursor >= now:
        return EventTablesResult(now, seconds=time.monotonic() - started)
    read = [*_READ, *(["metadata"] if domain.metadata_field is not None else [])]
    total: EventTablesResult | None = None
    while cursor is not None and cursor < now:  # the feed a window of commits at a time, each window committed
        upto = min(now, cursor + WINDOW)
        changes = _changes(events, cursor, upto, read)
        if changes is None:
            break
        keeper = keeper if total is None else _Keeper(warehouse, domain, key, upto)
        keeper.now = keeper.result.events_version = upto
        if total is not None:
            keeper.cursor()
        keeper.increment(changes, cursor)
        keeper.commit_mapping()
        total = keeper.result if total is None else total.add(keeper.result)
        cursor = upto
        if progress is not None and upto < now:
            progress(f"typed event tables: up to events version {upto} of {now}")
    if cursor is None or cursor < now:
        if not build:
            return total
        keeper = _Keeper(warehouse, domain, key, now)
        keeper.cursor()
        keeper.build(_current_rows(events_path, events, read), progress or (lambda _: None))
        keeper.commit_mapping(built=True)
        total = keeper.result if total is None else total.add(keeper.result)
    assert total is not None
    total.seconds = time.monotonic() - started
    return total


def _changes(events: DeltaTable, after: int, upto: int, read: list[str]) -> pa.Table | None:
    """The rows the `events` commits after..upto added, with their commit version; None when the feed cannot be read
    (then the tables are built anew from the current rows)."""
    try:
        reader = pa.RecordBatchReader.from_stream(events.load_cdf(
            starting_version=after + 1, ending_version=upto, columns=[*read, "_change_type", "_commit_version"]))
        batches = list(reader)
    except Exception as exc:  # noqa: BLE001 - a vacuumed or purged feed means a build; anything else re-raises
        if tables.change_feed_gone(exc) or "change data" in str(exc).lower():
            log.info("events' change feed after version %s cannot be read (%s): the typed event tables are built anew",
                     after, exc)
            return None
        raise
    table = feed.plain(pa.Table.from_batches(batches, schema=reader.schema))
    return table.filter(pc.equal(table["_change_type"], "insert"))


def _current_rows(path: str, events: DeltaTable, read: list[str]) -> Iterator[pa.Table]:
    """`events`' rows at the version `events` is loaded at, a build's step at a time."""
    dataset = feed.files(path, events)
    columns = [c for c in read if c in dataset.schema.names]
    if feed.has_deletion_vectors(events):  # its files alone are not its rows: DataFusion applies the vectors
        reader = QueryBuilder().register("events", events).execute(
            "SELECT " + ", ".join(f'"{c}"' for c in columns) + " FROM events")
        for batch in reader:
            yield feed.plain(pa.Table.from_batches([batch]))
        return
    for batch in dataset.to_batches(columns=columns, batch_size=CHUNK):
        yield pa.Table.from_batches([batch])


def _with_last(chunks: Iterator[pa.Table]) -> Iterator[tuple[pa.Table, bool]]:
    """Each chunk, and whether it is the last."""
    held = next(chunks, None)
    while held is not None:
        following = next(chunks, None)
        yield held, following is None
        held = following


class _Keeper:
    """One update's work: the mapping as read, the tables touched, what changed."""

    def __init__(self, warehouse: Location, domain: Domain, key: str, now: int) -> None:
        self.warehouse, self.domain, self.key, self.now = warehouse, domain, key, now
        self.app = APP_ID
        self.mapping_path = MAPPING.path(warehouse)
        self.result = EventTablesResult(now)
        self.names: dict[str, str] = {}  # event type → table name
        self.history: list[dict[str, Any]] = []  # the mapping's rows
        self.changed = False  # the mapping is rewritten
        self.lock = threading.Lock()  # the tables are written side by side: what they report goes through it

    # -- the mapping --------------------------------------------------------------------------------------------

    def cursor(self) -> int | None:
        """The `events` version every typed table is up to date with (None: build them), with the mapping read (its
        names are kept by a build too)."""
        if not tables.is_delta_table(self.mapping_path):
            return None
        mapping = _open(self.mapping_path)
        rows = feed.files(self.mapping_path, mapping).to_table().to_pylist()
        self.history = rows
        self.names = {r["event_type"]: r["table_name"] for r in rows}
        found = mapping.transaction_version(self.app)
        if found is None or mapping.metadata().configuration.get(BUILT_FOR) != self.key:
            return None
        return int(found)

    def commit_mapping(self, *, built: bool = False) -> None:
        """The mapping's rows (where they changed) and the cursor, last; after a build, what it was built for."""
        props = _props(self.app, self.now)
        if self.changed or not tables.is_delta_table(self.mapping_path):
            rows = pa.Table.from_pylist(self.history, schema=MAPPING.schema)
            write_deltalake(self.mapping_path, rows, mode="overwrite", schema_mode="overwrite", commit_properties=props)
            _OPEN.pop(self.mapping_path, None)
            if built:
                _open(self.mapping_path).alter.set_table_properties({BUILT_FOR: self.key}, raise_if_not_exists=False)
        else:
            mapping = _open(self.mapping_path)
            mapping.create_write_transaction([], mode="append", schema=mapping.schema(), commit_properties=props)

    def _name_for(self, event_type: str) -> str:
        """The table of `event_type`: the mapping's, else its own name (with a hash where another type holds it)."""
        held = self.names.get(event_type)
        if held is not None:
            return held
        name = table_name(event_type)
        if name in self.names.values() or _owner(tables.table_path(self.warehouse, name)) not in (None, event_type):
            name = f"{name}_{_digest(event_type, 8)}"  # another type's, or a table es_pipeline did not make
        self.names[event_type] = name
        return name

    def _record(self, event_type: str, name: str, column: str, t: pa.DataType, change: str, first: Any) -> None:
        with self.lock:
            self.history.append({"event_type": event_type, "table_name": name, "column_name": column,
                                 "data_type": shapes.sql_type(t), "change": change, "first_event_at": first,
                                 "events_version": self.now})
            self.changed = True

    # -- building and incrementing ------------------------------------------------------------------------------

    def build(self, chunks: Iterator[pa.Table], progress: Callable[[str], None]) -> None:
        """Every typed table anew from `events`' current rows: each type's first step overwrites its table, the
        last commit of each records the transaction id (a build cut short leaves the cursor unset: built again)."""
        self.result.rebuilt = True
        if tables.is_delta_table(self.mapping_path):  # until it ends, no cursor: a build cut short is built again
            _open(self.mapping_path).alter.set_table_properties({BUILT_FOR: "building"}, raise_if_not_exists=False)
        owned = set(self.names.values())
        self.history, self.changed = [], True
        kept_names = dict(self.names)  # the names types had: kept, so that a rebuild moves no table
        self.names = {}
        for event_type, name in sorted(kept_names.items()):
            if name not in self.names.values():
                self.names[event_type] = name
        started: set[str] = set()
        sealed: set[str] = set()  # written in the last step, with the transaction id
        seen = 0
        for chunk, last in _with_last(chunks):
            for event_type, rows in self._by_type(chunk):
                name = self._name_for(event_type)
                self._write(event_type, name, rows, fresh=name not in started,
                            props=_props(self.app, self.now) if last else None)
                started.add(name)
                if last:
                    sealed.add(name)
            seen += chunk.num_rows
            progress(f"typed event tables: {seen:,} events read, {len(started)} tables")
        for name in started - sealed:  # none in the last step: the id in a commit of its own
            target = _open(tables.table_path(self.warehouse, name))
            target.create_write_transaction([], mode="append", schema=target.schema(),
                                            commit_properties=_props(self.app, self.now))
        for name in sorted(owned - started):  # types no longer in `events`: their tables emptied
            path = tables.table_path(self.warehouse, name)
            if tables.is_delta_table(path):
                held = _open(path)
                empty = pa.Table.from_batches([], schema=feed.plain_schema(pa.schema(held.schema().to_arrow())))
                write_deltalake(path, empty, mode="overwrite", commit_properties=_props(self.app, self.now))
        self.names = {t: n for t, n in self.names.items() if n in started}

    def increment(self, changes: pa.Table, cursor: int) -> None:
        """The rows of the commits after `cursor`, each type's appended to its table past the version it records:
        the tables written side by side (delta-rs writes outside Python's lock)."""
        groups = [(event_type, event_type in self.names, self._name_for(event_type), rows)
                  for event_type, rows in sorted(self._by_type(changes), key=lambda g: g[0])]

        def one(event_type: str, known: bool, name: str, rows: pa.Table) -> None:
            path = tables.table_path(self.warehouse, name)
            target = _open(path) if known or tables.is_delta_table(path) else None
            done = None if target is None else target.transaction_version(self.app)
            if not known and target is not None and done is not None:  # made by a run cut short before the mapping
                for f in normal_schema(target):
                    if f.name not in ENVELOPE.names or f.name == shapes.OVERFLOW:
                        self._record(event_type, name, f.name, f.type, "added", None)
            if done is not None and int(done) >= self.now:
                return  # a run cut short after this table's commit wrote these rows
            if known and done is None:  # the table lost: its type's rows from `events` anew
                self._write(event_type, name, self._rows_of(event_type), fresh=True, props=_props(self.app, self.now))
                return
            if done is not None and int(done) > cursor:
                rows = rows.filter(pc.greater(rows["_commit_version"], int(done)))
            fresh = not known and done is None
            self._write(event_type, name, rows, fresh=fresh, props=_props(self.app, self.now),
                        target=None if fresh else target)

        if len(groups) < 2:
            for group in groups:
                one(*group)
            return
        with ThreadPoolExecutor(WRITERS) as pool:
            for future in [pool.submit(one, *group) for group in groups]:
                future.result()

    def _rows_of(self, event_type: str) -> pa.Table:
        """`events`' rows of `event_type` (as the tables group them) at the version read."""
        path = tables.table_path(self.warehouse, "events")
        read = [*_READ, *(["metadata"] if self.domain.metadata_field is not None else [])]
        # At the version this update commits as read: a later commit's rows come with a later update.
        parts = [rows for chunk in _current_rows(path, DeltaTable(path, version=self.now), read)
                 for t, rows in self._by_type(chunk)
                 if t == event_type]
        return pa.concat_tables(parts) if parts else pa.table({c: [] for c in _READ})

    def _by_type(self, rows: pa.Table) -> Iterator[tuple[str, pa.Table]]:
        """`rows` grouped by the event type their table is for (the base type, where the domain reads versions from
        the type's suffix), in `events`' order within a group."""
        if rows.num_rows == 0:
            return
        rows = tables.tenant_filled(rows) if "tenant" in rows.column_names else rows
        kinds = rows["event_type"].combine_chunks()
        if self.domain.schema_version == "suffix":
            kinds = pa.array([self.domain.base_type(k) for k in kinds.to_pylist()], pa.string())
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
            group = sorted_rows.slice(lo, hi - lo)
            yield names[codes[lo].as_py()], group

    def _write(self, event_type: str, name: str, rows: pa.Table, *, fresh: bool, props: CommitProperties | None,
               target: DeltaTable | None = None) -> None:
        """`rows` (of one type) typed and written to table `name`: overwriting it where `fresh`, else appended (its
        schema evolved or its columns widened, as the rows need). `target`: the table, loaded up to date already."""
        path = tables.table_path(self.warehouse, name)
        if target is None and not fresh and tables.is_delta_table(path):
            target = _open(path)
        target = None if fresh else target
        held = None if target is None else normal_schema(target)
        if fresh:
            with self.lock:
                self.history = [r for r in self.history if r["event_type"] != event_type]
        typed = type_rows(rows, held, domain=self._upcasting(event_type),
                          declared=self.domain.event_schemas.get(event_type))
        if fresh or target is None:
            if not tables.is_delta_table(path):  # made with its owner (the type it holds), then its rows
                made = DeltaTable.create(path, typed.rows.schema, mode="ignore")
                made.alter.set_table_properties({OWNER: event_type}, raise_if_not_exists=False)
            write_deltalake(path, typed.rows, mode="overwrite", schema_mode="overwrite", commit_properties=props)
            _OPEN.pop(path, None)
            if fresh and name not in self.result.rows:
                with self.lock:
                    self.result.new_tables.append(name)
            for f in typed.rows.schema:
                if f.name not in ENVELOPE.names or f.name == shapes.OVERFLOW:
                    self._record(event_type, name, f.name, f.type, "added", typed.first_at.get(f.name))
        elif typed.widened:
            assert target is not None
            before = _spill_rounded(feed.files(path, target).to_table(), typed.widened)
            widened = typed.rows.schema
            old = pa.table([shapes.widen_column(before[f.name], f.type) if f.name in before.column_names
                            else pa.nulls(before.num_rows, f.type) for f in widened], schema=widened)
            write_deltalake(path, pa.concat_tables([old, typed.rows]), mode="overwrite", schema_mode="overwrite",
                            commit_properties=props)
            _OPEN.pop(path, None)
        else:
            assert target is not None
            write_deltalake(target, typed.rows, mode="append", schema_mode="merge" if typed.added else None,
                            commit_properties=props)
        if not fresh and target is not None:
            for column in typed.added:
                t = typed.rows.schema.field(column).type
                self._record(event_type, name, column, t, "added", typed.first_at.get(column))
                with self.lock:
                    self.result.new_columns.append(f"{name}.{column} {shapes.sql_type(t)}")
            for column, (old_type, new_type) in typed.widened.items():
                self._record(event_type, name, column, new_type, f"widened from {shapes.sql_type(old_type)}",
                             typed.first_at.get(column))
                with self.lock:
                    self.result.widened.append(f"{name}.{column}: {shapes.sql_type(old_type)} → {shapes.sql_type(new_type)}")
        with self.lock:
            if fresh and props is not None and name not in self.result.new_tables:
                self.result.new_tables.append(name)
            self.result.rows[name] = self.result.rows.get(name, 0) + typed.rows.num_rows
            if typed.overflowed:
                self.result.overflow[name] = self.result.overflow.get(name, 0) + typed.overflowed

    def _upcasting(self, event_type: str) -> Domain | None:
        """The domain where its upcasters may change this type's payloads, else None (the payloads read as they are)."""
        d = self.domain
        if d.schema_version == "suffix" or any(u.event_type == event_type for u in d.upcasters.values()):
            return d
        return None


def _spill_rounded(rows: pa.Table, widened: dict[str, tuple[pa.DataType, pa.DataType]]) -> pa.Table:
    """A table's rows before a widening, with each whole number a new double column would round moved from its
    column into the row's `_overflow` (so the rewrite loses no digit)."""
    for column, (old, new) in widened.items():
        if not (pa.types.is_integer(old) and pa.types.is_floating(new)) or column not in rows.column_names:
            continue
        values = rows[column]
        big = pc.fill_null(pc.greater(pc.abs(values), shapes.EXACT), False)
        if not pc.any(big).as_py():
            continue
        spills = rows[shapes.OVERFLOW].to_pylist()
        for i in pc.indices_nonzero(big).to_pylist():
            held = json.loads(spills[i]) if spills[i] else {}
            spills[i] = shapes.json_text({**held, field_of(column): values[i].as_py()})
        rows = rows.set_column(rows.column_names.index(column), column, pc.if_else(big, None, values))
        rows = rows.set_column(rows.column_names.index(shapes.OVERFLOW), shapes.OVERFLOW, pa.array(spills, pa.string()))
    return rows


def _owner(path: str) -> str | None:
    """The event type of the typed table at `path` ('' for a Delta table es_pipeline did not make), or None: none there."""
    if not tables.is_delta_table(path):
        return None
    return str(DeltaTable(path).metadata().configuration.get(OWNER, ""))


_OPEN: dict[str, DeltaTable] = {}  # the tables this process has loaded, each brought up to date before use


def _open(path: str) -> DeltaTable:
    """The table at `path` at its latest version: loaded once per process, then updated from its log's new commits."""
    held = _OPEN.get(path)
    if held is not None:
        try:
            held.update_incremental()
            return held
        except Exception:  # noqa: BLE001 - made anew or cleaned up under us: loaded whole again
            _OPEN.pop(path, None)
    table = _OPEN[path] = DeltaTable(path)
    return table


def _props(app: str, version: int) -> CommitProperties:
    return CommitProperties(app_transactions=[Transaction(app, version)])


# -- typing one type's rows ---------------------------------------------------------------------------------------


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
