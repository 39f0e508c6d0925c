"""Typed event tables: one Delta table per event type, a column per payload field, kept without the team's code.

`events` holds each payload as JSON text. For every event type in it, es_pipeline keeps `events_<type>`
(`ItemAdded` → `events_item_added`): the envelope (tenant, stream id and type, version, event type, recorded
time, event date, tx id, global position), `_overflow`, then one column per payload field, typed by the rule of
lake/typed/shapes.py and widened as payloads change. Where the domain registered upcasters, the table holds each
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

**Typing** a batch of one type's rows is lake/typed/typed_rows.py's (Arrow's JSON reader, or value by value by the
rule of lake/typed/shapes.py); this module decides which table takes them and how.

**Widening** a column rewrites its table once (its rows read back, the column converted, all written in one
commit): readers then need no Delta type-widening support. A new column is added by schema evolution, no
rewrite. Hundreds of types stay cheap: an update touches the tables of the types it saw, each loaded once per
process and brought up to date incrementally.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, write_deltalake

from es_pipeline.domain import EVENT_TABLE_PREFIX, EVENT_TABLES, Domain
from es_pipeline.lake.delta import arrow_append, current, pieces, tables
from es_pipeline.lake.delta.definition import Table
from es_pipeline.lake.delta.tables import UTC_MICROS, Location
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel import position, runner
from es_pipeline.lake.kernel.engine import HERE, Engine
from es_pipeline.lake.kernel.feed import Feed
from es_pipeline.lake.kernel.position import Position
from es_pipeline.lake.kernel.projection import Increment, Kind
from es_pipeline.lake.kernel.result import Ran, Result
from es_pipeline.lake.kernel.turn import Turn, one_at_a_time
from es_pipeline.lake.typed import on_spark, shapes
from es_pipeline.lake.typed.typed_rows import (
    ENVELOPE,
    by_type,
    normal_schema,
    regrown,
    to_place_again,
    type_rows,
    upcasting,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

PREFIX = EVENT_TABLE_PREFIX
NAME = EVENT_TABLES  # the mapping table
REVISION = 2  # of the rule in lake/typed/shapes.py and of this layout: a change rebuilds every typed event table
CHUNK = 1_000_000  # events per step of a build
WRITERS = 4  # tables an increment writes at once
WINDOW = 4  # `events` commits an increment reads at once (an extraction commits up to 500,000 events in one)

_READ = ["tenant", "stream_id", "stream_type", "version", "event_type", "recorded_at", "event_date", "tx_id",
         "global_position", "payload", "payload_encoding"]

MAPPING = Table(NAME, pa.schema([
    ("event_type", pa.string()), ("table_name", pa.string()), ("column_name", pa.string()), ("data_type", pa.string()),
    ("change", pa.string()), ("first_event_at", UTC_MICROS), ("events_version", pa.int64()),
]), key=("event_type", "column_name", "data_type"), comment="which typed event table holds which event type; each column's history")


@dataclass
class _Written:
    """What an update wrote: the `events` version it brought every typed table to, and per table what it wrote."""

    events_version: int
    rebuilt: bool = False
    rows: dict[str, int] = field(default_factory=dict)  # table → rows written
    new_tables: list[str] = field(default_factory=list)
    new_columns: list[str] = field(default_factory=list)  # "table.column type"
    widened: list[str] = field(default_factory=list)  # "table.column: old → new"
    overflow: dict[str, int] = field(default_factory=dict)  # table → values kept in `_overflow`

    def add(self, later: _Written) -> _Written:
        """This update's figures followed by `later`'s (an update made of several windows)."""
        rows = dict(self.rows)
        for name, n in later.rows.items():
            rows[name] = rows.get(name, 0) + n
        overflow = dict(self.overflow)
        for name, n in later.overflow.items():
            overflow[name] = overflow.get(name, 0) + n
        return _Written(later.events_version, self.rebuilt or later.rebuilt, rows,
                        [*self.new_tables, *later.new_tables], [*self.new_columns, *later.new_columns],
                        [*self.widened, *later.widened], overflow)

    def result(self, previous: int, engine: Ran = "local") -> Result:
        """As the kernel's `Result` (its figures as the asset shows them)."""
        return Result(NAME, self.events_version, -1 if self.rebuilt else previous, sum(self.rows.values()), engine,
                      figures={"tables_written": len(self.rows), "tables": ", ".join(sorted(self.rows)) or "-",
                               "new_tables": ", ".join(self.new_tables) or "-",
                               "new_columns": ", ".join(self.new_columns) or "-",
                               "widened_columns": ", ".join(self.widened) or "-",
                               "overflow_values": sum(self.overflow.values()),
                               **{f"overflow/{name}": n for name, n in sorted(self.overflow.items())}})


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
BUILT_FROM = "es_pipeline.event_tables.built_from"  # and the Delta id of the `events` it follows (for health)
BUILDING = "building"  # BUILT_FOR while a whole build is under way
OWNER = "es_pipeline.event_table"  # a typed table's property: the event type it holds (only such tables are touched)


def build_key(events_id: str, definition: str) -> str:
    """What a build is valid for: the `events` table and the definition. The mapping records it once a build has
    finished (and clears it as one starts): any other value means the tables are built anew, so that a changed
    definition, or one changed back, never appends to tables built under another."""
    return _digest(events_id + definition, 16)


def _digest(text: str, n: int) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:n]


def update(warehouse: Location, domain: Domain, *, store_dsn: str | None = None,
           progress: Callable[[str], None] | None = None, engine: Engine = HERE) -> Result:
    """Bring every typed event table up to `events` now, in the `event_tables` turn (lake/kernel/turn.py), by the
    kernel's runner; `NoEventsYet` before `events` exists. `engine`: where a whole build runs (the engine rule,
    applied by the kernel's runner); increments always run here."""
    return runner.update(EventTables(warehouse, domain, progress=progress), engine, warehouse, store_dsn=store_dsn)


def increment(warehouse: Location, domain: Domain, turn: Turn | None = None,
              events_feed: Feed | None = None) -> Result | None:
    """The increment alone (a tailing run's, in its `turn`), or None where the tables would be built anew (left to
    the asset's own run). A window whose change feed cannot be read stops it: its result says it is short."""
    if turn is None:
        with one_at_a_time(None, NAME) as own:
            return runner.increment(EventTables(warehouse, domain), warehouse, own, events_feed)
    return runner.increment(EventTables(warehouse, domain), warehouse, turn, events_feed)


class EventTables(Kind):
    """The typed event tables as one kind of the projection kernel (lake/kernel/projection.py): the position is the
    mapping's transaction id (the cursor), valid for the build key its properties record; an increment folds a
    window of `WINDOW` commits at a time, each committed (every table's rows, then the mapping)."""

    table = MAPPING
    name = NAME
    increments_in_process = True

    def __init__(self, warehouse: Location, domain: Domain, *, progress: Callable[[str], None] | None = None) -> None:
        self.warehouse, self.domain = warehouse, domain
        self.progress = progress or (lambda _: None)
        self.columns = [*_READ, *(["metadata"] if domain.metadata_field is not None else [])]
        self.keeper: _Keeper | None = None
        self.total: _Written | None = None
        self.previous = -1

    @property
    def window(self) -> int:  # type: ignore[override]
        return WINDOW  # read at each update (a test sets a smaller one)

    def app_id(self, events_id: str) -> str:
        return APP_ID  # not bound to `events`: the build key in the mapping's properties is

    def open(self, path: str) -> DeltaTable:
        return _open(path)  # the mapping, kept open between a tailing run's increments

    def ready(self, path: str, target: DeltaTable, events_id: str) -> DeltaTable | None:
        keeper = _Keeper(self.warehouse, self.domain, build_key(events_id, definition_of(self.domain)), -1, events_id)
        if keeper.cursor() is None:
            return None  # built for another `events` or definition, or a build cut short: built anew
        self.keeper = keeper
        return target

    def up_to_date(self, target: DeltaTable, position: Position, now: int) -> Result:
        assert position.events_version is not None
        return _Written(now).result(position.events_version)

    def fold(self, rows: pa.Table, increment: Increment) -> _Window:
        assert self.keeper is not None and increment.position.folded is not None
        if self.total is None:
            self.previous = increment.previous
        return _Window(self, increment, rows)

    def build_here(self, warehouse: Location, turn: Turn, engine: Engine) -> Result | None:
        events_path = EVENTS.path(warehouse)
        events = DeltaTable(events_path)
        keeper = self._for_build(events)
        keeper.build(_current_rows(events_path, events, self.columns), self.progress)
        keeper.commit_mapping(built=True)
        return keeper.result.result(-1)

    def update_on_spark(self, spark: SparkSession, warehouse: Location, turn: Turn) -> Result:
        events_path = EVENTS.path(warehouse)
        keeper = self._for_build(DeltaTable(events_path))
        keeper.build_on_spark(spark, events_path, self.columns, self.progress)
        keeper.commit_mapping(built=True)
        return keeper.result.result(-1, engine="spark")

    def _for_build(self, events: DeltaTable) -> _Keeper:
        """A keeper for a whole build of `events` as loaded (the names the mapping kept, read)."""
        now, events_id = int(events.version()), str(events.metadata().id)
        keeper = _Keeper(self.warehouse, self.domain, build_key(events_id, definition_of(self.domain)), now, events_id)
        keeper.cursor()
        keeper.next_window(now)
        return keeper


@dataclass(frozen=True)
class _Window:
    """A window of the increment, written in the table's turn once confirmed: each type's rows to its table (with
    the table's own transaction id: a replay skips what a run cut short wrote), then the mapping's rows and the
    cursor, last."""

    kind: EventTables
    increment: Increment
    rows: pa.Table

    def commit(self, txn: int) -> Result:
        kind, cursor = self.kind, self.increment.position.folded
        assert kind.keeper is not None and cursor is not None and txn == self.increment.now
        kind.keeper.next_window(txn)  # the mapping as this process committed it: not read again
        kind.keeper.increment(self.rows, cursor)
        kind.keeper.commit_mapping()
        kind.total = kind.keeper.result if kind.total is None else kind.total.add(kind.keeper.result)
        if txn < self.increment.feed.version:
            kind.progress(f"typed event tables: up to events version {txn} of {self.increment.feed.version}")
        return kind.total.result(kind.previous)


def _current_rows(path: str, events: DeltaTable, read: list[str]) -> Iterator[pa.Table]:
    """`events`' rows at the version `events` is loaded at, a build's step (`CHUNK` events) at a time, read a batch
    at a time (lake/delta/pieces.py): memory for one step, whatever `events`' size."""
    return pieces.chunks(pieces.batches(path, events, read), CHUNK)


def _with_last(chunks: Iterator[pa.Table]) -> Iterator[tuple[pa.Table, bool]]:
    """Each chunk, and whether it is the last."""
    held = next(chunks, None)
    while held is not None:
        following = next(chunks, None)
        yield held, following is None
        held = following


class _Keeper:
    """One update's work: the mapping as read, the tables touched, what changed."""

    def __init__(self, warehouse: Location, domain: Domain, key: str, now: int, events_id: str) -> None:
        self.warehouse, self.domain, self.key, self.now, self.events_id = warehouse, domain, key, now, events_id
        self.app = APP_ID
        self.mapping_path = MAPPING.path(warehouse)
        self.result = _Written(now)
        self.names: dict[str, str] = {}  # event type → table name
        self.history: list[dict[str, Any]] = []  # the mapping's rows
        self.changed = False  # the mapping is rewritten
        self.lock = threading.Lock()  # the tables are written side by side: what they report goes through it

    def next_window(self, upto: int) -> None:
        """Go on to the `events` commits up to `upto`, with the names and history held (as committed so far)."""
        self.now, self.result, self.changed = upto, _Written(upto), False

    # -- the mapping --------------------------------------------------------------------------------------------

    def cursor(self) -> int | None:
        """The `events` version every typed table is up to date with (None: build them), with the mapping read (its
        names are kept by a build too)."""
        if not tables.is_delta_table(self.mapping_path):
            return None
        mapping = _open(self.mapping_path)
        rows = current.files(self.mapping_path, mapping).to_table().to_pylist()
        self.history = rows
        self.names = {r["event_type"]: r["table_name"] for r in rows}
        found = mapping.transaction_version(self.app)
        if found is None or mapping.metadata().configuration.get(BUILT_FOR) != self.key:
            return None
        return int(found)

    def commit_mapping(self, *, built: bool = False) -> None:
        """The mapping's rows (where they changed) and the cursor, last; after a build, what it was built for."""
        props = position.commit_properties(self.app, self.now)
        if self.changed or not tables.is_delta_table(self.mapping_path):
            rows = pa.Table.from_pylist(self.history, schema=MAPPING.schema)
            write_deltalake(self.mapping_path, rows, mode="overwrite", schema_mode="overwrite", commit_properties=props)
            _OPEN.pop(self.mapping_path, None)
            if built:
                _open(self.mapping_path).alter.set_table_properties({BUILT_FOR: self.key, BUILT_FROM: self.events_id},
                                                                    raise_if_not_exists=False)
        else:
            position.record(_open(self.mapping_path), props)
        mapping = _open(self.mapping_path)
        if mapping.metadata().configuration.get(BUILT_FROM) != self.events_id:  # a mapping built by an older release
            mapping.alter.set_table_properties({BUILT_FROM: self.events_id}, raise_if_not_exists=False)

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
        owned = self._start_build()
        started: set[str] = set()
        sealed: set[str] = set()  # written in the last step, with the transaction id
        seen = 0
        for chunk, last in _with_last(chunks):
            for event_type, rows in by_type(chunk, self.domain):
                name = self._name_for(event_type)
                self._write(event_type, name, rows, fresh=name not in started,
                            props=position.commit_properties(self.app, self.now) if last else None)
                started.add(name)
                if last:
                    sealed.add(name)
            seen += chunk.num_rows
            progress(f"typed event tables: {seen:,} events read, {len(started)} tables")
        for name in started - sealed:  # none in the last step: the id in a commit of its own
            position.record(_open(tables.table_path(self.warehouse, name)), position.commit_properties(self.app, self.now))
        self._end_build(owned, started)

    def _start_build(self) -> set[str]:
        """A whole build begun: the mapping's cursor voided (a build cut short is built again), its history
        cleared, the names types had kept (a rebuild moves no table); the tables the mapping held."""
        self.result.rebuilt = True
        if tables.is_delta_table(self.mapping_path):  # until it ends, no cursor: a build cut short is built again
            _open(self.mapping_path).alter.set_table_properties({BUILT_FOR: BUILDING}, raise_if_not_exists=False)
        owned = set(self.names.values())
        self.history, self.changed = [], True
        kept_names = dict(self.names)
        self.names = {}
        for event_type, name in sorted(kept_names.items()):
            if name not in self.names.values():
                self.names[event_type] = name
        return owned

    def _end_build(self, owned: set[str], started: set[str]) -> None:
        """A whole build ended: the tables of types no longer in `events` emptied, and forgotten."""
        for name in sorted(owned - started):
            path = tables.table_path(self.warehouse, name)
            if tables.is_delta_table(path):
                held = _open(path)
                empty = pa.Table.from_batches([], schema=current.plain_schema(pa.schema(held.schema().to_arrow())))
                write_deltalake(path, empty, mode="overwrite", commit_properties=position.commit_properties(self.app, self.now))
        self.names = {t: n for t, n in self.names.items() if n in started}

    def build_on_spark(self, spark: SparkSession, events_path: str, read: list[str],
                       progress: Callable[[str], None]) -> None:
        """`build` on Spark (lake/typed/on_spark.py): each type's columns found over all its rows, then every table's
        rows typed and written on the executors, two jobs in all; each table's files committed by delta-rs with
        the transaction id."""
        owned = self._start_build()
        events = on_spark.source(spark, events_path, self.now, read)
        columns = on_spark.shapes_of(events, self.domain)
        progress(f"typed event tables on Spark: the columns of {len(columns)} types found over events version "
                 f"{self.now}")
        targets = {}
        for kind in sorted(columns):
            name = self._name_for(kind)
            schema = on_spark.schema_of(columns[kind])
            path = tables.table_path(self.warehouse, name)
            if not tables.is_delta_table(path):  # made with its owner (the type it holds), then its rows
                made = DeltaTable.create(path, schema, mode="ignore")
                made.alter.set_table_properties({OWNER: kind}, raise_if_not_exists=False)
            elif normal_schema(_open(path)) != schema:  # its columns as the build found them, before its rows
                write_deltalake(path, schema.empty_table(), mode="overwrite", schema_mode="overwrite")
            targets[kind] = on_spark.Target(path, arrow_append.new_folder("spark-build"), schema)
        placed = on_spark.place(events, self.domain, targets)
        progress(f"typed event tables on Spark: {sum(p.rows for p in placed.values()):,} events written for "
                 f"{len(placed)} tables")

        def commit(kind: str) -> None:
            target, got, name = targets[kind], placed[kind], self.names[kind]
            arrow_append.commit_parquet_folder(target.path, target.schema, target.folder, app_id=self.app,
                                               version=self.now, expect_rows=got.rows, overwrite=True, files=got.files)
            _OPEN.pop(target.path, None)
            for f in target.schema:
                if f.name not in ENVELOPE.names or f.name == shapes.OVERFLOW:
                    self._record(kind, name, f.name, f.type, "added", got.first_at.get(f.name))
            with self.lock:
                self.result.new_tables.append(name)
                self.result.rows[name] = got.rows
                if got.overflowed:
                    self.result.overflow[name] = got.overflowed

        with ThreadPoolExecutor(WRITERS) as pool:
            for future in [pool.submit(commit, kind) for kind in sorted(targets)]:
                future.result()
        self._end_build(owned, {self.names[kind] for kind in targets})

    def increment(self, changes: pa.Table, cursor: int) -> None:
        """The rows of the commits after `cursor`, each type's appended to its table past the version it records:
        the tables written side by side (delta-rs writes outside Python's lock)."""
        groups = [(event_type, event_type in self.names, self._name_for(event_type), rows)
                  for event_type, rows in sorted(by_type(changes, self.domain), key=lambda g: g[0])]

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
                self._write(event_type, name, self._rows_of(event_type), fresh=True, props=position.commit_properties(self.app, self.now))
                return
            if done is not None and int(done) > cursor:
                rows = rows.filter(pc.greater(rows["_commit_version"], int(done)))
            fresh = not known and done is None
            self._write(event_type, name, rows, fresh=fresh, props=position.commit_properties(self.app, self.now),
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
        path = EVENTS.path(self.warehouse)
        read = [*_READ, *(["metadata"] if self.domain.metadata_field is not None else [])]
        # At the version this update commits as read: a later commit's rows come with a later update.
        parts = [rows for chunk in _current_rows(path, DeltaTable(path, version=self.now), read)
                 for t, rows in by_type(chunk, self.domain)
                 if t == event_type]
        return pa.concat_tables(parts) if parts else pa.table({c: [] for c in _READ})

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
        typed = type_rows(rows, held, domain=upcasting(self.domain, event_type),
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
        elif changed := to_place_again(typed, lambda: current.files(path, target).to_table(
                columns=[shapes.OVERFLOW])[shapes.OVERFLOW]):
            assert target is not None  # earlier rows placed again: a widened column, or an overflow a new one takes
            old = regrown(current.files(path, target).to_table(), typed.rows.schema, changed)
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
            if tables.first_commit_id(path) in (None, str(held.metadata().id)):  # else made anew (`lake rebuild`)
                held.update_incremental()
                return held
        except Exception:  # noqa: BLE001 - made anew or cleaned up under us: loaded whole again
            pass
        _OPEN.pop(path, None)
    table = _OPEN[path] = DeltaTable(path)
    return table
