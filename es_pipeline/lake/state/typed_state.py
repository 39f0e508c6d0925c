"""Typed state: a table per stream type whose reducer declares its state, one column per field.

`stream_state` holds every stream's state as JSON text. A reducer that declares what its state holds (a
dataclass, a TypedDict or an Arrow schema: `Domain.reducer(..., state=...)`) gives its stream type a table
`stream_state_<type>` too: the stream's key, version, last event time, revision and update time, then one
column per field of the state, so an analyst asks `SELECT count(*) FROM stream_state_cart WHERE status =
'open'` without parsing JSON.

Kept from `stream_state` itself, in its turn, right after each update: the rows that `stream_state`'s
commits since the version a typed table records changed (its change data feed: inserts and updates'
post-images), the latest per stream, upserted by delta-rs under the table's own Delta transaction id
(`es_pipeline.stream_state_<type>@<events id>/<stream_state id>`: the `stream_state` version read, of that
`stream_state` folded from that `events`; lake/delta/definition.py `over`). A state row is the stream's whole
state, so upserting one again is harmless: a crash between the two commits, or a replay, leaves the same
rows. A table that is new, whose declared fields changed, or whose feed cannot be read (vacuumed, or from
before the feed was on) is rebuilt from `stream_state`'s current rows of its type, alone.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, write_deltalake

from es_pipeline.domain import STATE_TABLE_PREFIX, Domain, Reducer
from es_pipeline.errors import DomainError, TypedStateMismatch
from es_pipeline.lake.delta import current, tables
from es_pipeline.lake.delta.definition import Table
from es_pipeline.lake.delta.tables import UTC_MICROS, Location
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel import position
from es_pipeline.lake.state import state_json
from es_pipeline.lake.state.fold import Written

log = logging.getLogger(__name__)

PREFIX = STATE_TABLE_PREFIX
# `quarantined`: as `stream_state`'s (JSON, null for a healthy stream; docs/decisions/0051): a held stream says so here.
_ENVELOPE = pa.schema([("tenant", pa.string()), ("stream_id", pa.string()), ("version", pa.int32()),
                       ("last_event_at", UTC_MICROS), ("revision", pa.int32()), ("updated_at", UTC_MICROS),
                       ("quarantined", pa.string())])
CHANGE_FEED = {"delta.enableChangeDataFeed": "true"}  # on `stream_state`: what the typed tables follow


def table_name(stream_type: str) -> str:
    """`stream_state_<type>`: the type lowercased, each run of other characters than letters and digits one `_`."""
    return PREFIX + (re.sub(r"[^a-z0-9]+", "_", stream_type.lower()).strip("_") or "_")


def typed_tables(domain: Domain) -> dict[str, tuple[Reducer, Table]]:
    """Per stream type whose reducer declares its state: (the reducer, its table)."""
    out: dict[str, tuple[Reducer, Table]] = {}
    names: dict[str, str] = {}
    for stream_type, reducer in sorted(domain.reducers.items()):
        if reducer.state is None:
            continue
        name = table_name(stream_type)
        if name in names:
            raise DomainError(f"stream types {names[name]!r} and {stream_type!r} would both have typed table {name}",
                              "Declare the state of one of them only, or rename a stream type.")
        names[name] = stream_type
        schema = pa.schema([*_ENVELOPE, *reducer.state])
        out[stream_type] = (reducer, Table(name, schema, key=("tenant", "stream_id"),
                                           comment=f"typed state of the {stream_type} streams"))
    return out


def state_properties(domain: Domain) -> dict[str, str]:
    """The properties a new `stream_state` is made with: its change feed on if `domain` has typed tables."""
    return dict(CHANGE_FEED) if typed_tables(domain) else {}


def update(warehouse: Location, domain: Domain, commit: Written | None = None) -> dict[str, int]:
    """Bring every typed table of `domain` up to `stream_state` now; rows written per table. Only in
    `stream_state`'s turn (lake/state/stream_state.py calls it there). `commit`: the `stream_state` commit this process
    just made; a table that was up to date before it takes its rows from there (appended where every stream is
    new), not from the change feed."""
    typed = typed_tables(domain)
    state_path = tables.table_path(warehouse, "stream_state")
    events_path = EVENTS.path(warehouse)
    if not typed or not tables.is_delta_table(state_path) or not tables.is_delta_table(events_path):
        return {}
    # Bound to the `events` table stream_state folds now and to the stream_state table itself (its versions are the
    # position): after a rebuild from another `events`, or a stream_state made anew, each is built whole.
    source_id = f"{tables.table_id(events_path)}/{tables.table_id(state_path)}"
    loaded: list[DeltaTable] = []

    def state() -> DeltaTable:  # loaded only where a table needs more than `commit`
        if not loaded:
            loaded.append(DeltaTable(state_path))
        return loaded[0]

    feed_on = (commit is not None and state_path in _FEED_ON) or \
        state().metadata().configuration.get("delta.enableChangeDataFeed") == "true"
    if not feed_on:  # a table made before typed tables: its feed starts now; each typed table is built whole
        state().alter.set_table_properties(CHANGE_FEED)
        loaded.clear()
    _FEED_ON.add(state_path)
    now = commit.after if commit is not None else int(state().version())
    written: dict[str, int] = {}
    feeds: dict[int, pa.Table | None] = {}  # stream_state's changes after a version, read once for every table there
    for stream_type, (reducer, table) in typed.items():
        path = table.path(warehouse)
        checked = (path, table.schema.to_string())
        if commit is not None and checked in _CHECKED and not pc.any(pc.equal(
                commit.rows["stream_type"], stream_type)).as_py() and tables.is_delta_table(path):
            continue  # nothing of its type in the commit: its rows stand; its version catches up when its type moves
        target = DeltaTable(path) if feed_on and tables.is_delta_table(path) else None  # its log, loaded once
        app = table.app_id_over(source_id)
        found = None if target is None else target.transaction_version(app)
        read = None if found is None else int(found)
        if target is not None and read is not None and not _same_columns(target, table.schema):
            read = None  # its fields changed: built whole
        if read is not None:
            _CHECKED.add(checked)
        if read is not None and read >= now:
            continue
        props = position.commit_properties(app, now)
        if commit is not None and read == commit.before:  # the one commit since: its rows, as written
            of_type = pc.equal(commit.rows["stream_type"], stream_type)
            rows = _typed(commit.rows.filter(of_type).select(_STATE_COLUMNS), reducer, table)
            assert target is not None
            if rows.num_rows and pc.all(commit.inserted.filter(of_type)).as_py():
                write_deltalake(target, rows, mode="append", commit_properties=props)  # new streams only
            elif rows.num_rows:
                _upsert(target, rows, props)
            else:
                position.record(target, props)
            written[table.name] = rows.num_rows
            continue
        if read is not None and read not in feeds:
            feeds[read] = _changes(state(), read, now)
        changes = None if read is None else feeds[read]
        changed = None if changes is None else _latest(changes, stream_type)
        if changed is None:
            current = _current(state_path, state(), stream_type)
            if current.num_rows and not pc.all(pc.equal(current["revision"], domain.folds[stream_type].revision)).as_py():
                # Rows of another revision: the type is being rebuilt beside `stream_state` (lake/state/rebuild.py),
                # whose swap this table follows; its fields may not fit those rows.
                continue
            rows = _typed(current, reducer, table)
            write_deltalake(path, rows, mode="overwrite", schema_mode="overwrite", commit_properties=props,
                            configuration=table.properties or None)
        else:
            rows = _typed(changed, reducer, table)
            assert target is not None and changes is not None
            if rows.num_rows and _all_new(changes, rows):
                write_deltalake(target, rows, mode="append", commit_properties=props)  # streams new since `read`
            elif rows.num_rows:
                _upsert(target, rows, props)
            else:
                position.record(target, props)
        written[table.name] = rows.num_rows
    return written


# (path, declared columns) of the typed tables this process has found with those columns: a declaration changes
# only with the code, so such a table, untouched by a commit, needs no look (its log's load costs an increment).
_CHECKED: set[tuple[str, str]] = set()
_FEED_ON: set[str] = set()  # the stream_state tables this process has found with their change feed on (it stays on)


def _all_new(changes: pa.Table, rows: pa.Table) -> bool:
    """Whether every stream of `rows` was inserted into `stream_state` within `changes`: then the typed table, at
    the version before them, holds none of them."""
    inserted = changes.filter(pc.equal(changes["_change_type"], "insert"))
    keys = pc.binary_join_element_wise(inserted["tenant"], inserted["stream_id"], "\x00")
    return bool(pc.all(pc.is_in(pc.binary_join_element_wise(rows["tenant"], rows["stream_id"], "\x00"), keys)).as_py())


def _upsert(target: DeltaTable, rows: pa.Table, props: CommitProperties) -> None:
    target.merge(rows, predicate="t.tenant = u.tenant AND t.stream_id = u.stream_id", source_alias="u",
                 target_alias="t", commit_properties=props).when_matched_update_all().when_not_matched_insert_all() \
        .execute()


def _same_columns(table: DeltaTable, schema: pa.Schema) -> bool:
    held = pa.schema(table.schema().to_arrow())
    return [(f.name, current.plain_schema(pa.schema([f])).field(0).type) for f in held] == \
        [(f.name, f.type) for f in schema]


_STATE_COLUMNS = ["tenant", "stream_id", "stream_type", "version", "state", "last_event_at", "revision", "updated_at",
                  "quarantined"]


def _changes(state: DeltaTable, after: int, upto: int) -> pa.Table | None:
    """The rows that `stream_state`'s commits after..upto inserted or updated (their post-images), with their commit
    version; None: the feed cannot be read (vacuumed away, or those commits are from before it was on)."""
    try:
        reader = pa.RecordBatchReader.from_stream(state.load_cdf(
            starting_version=after + 1, ending_version=upto, columns=[*_STATE_COLUMNS, "_change_type",
                                                                        "_commit_version"]))
        rows = current.plain(reader.read_all())
    except Exception as exc:  # noqa: BLE001 - an unreadable feed rebuilds the table; anything else re-raises
        if tables.change_feed_gone(exc) or "change data" in str(exc).lower() or "cdf" in str(exc).lower():
            log.info("stream_state's change feed after %s cannot be read (%s): its typed tables are rebuilt", after, exc)
            return None
        raise
    return rows.filter(pc.is_in(rows["_change_type"], pa.array(["insert", "update_postimage"])))


def _latest(changes: pa.Table, stream_type: str) -> pa.Table:
    """The latest row of each stream of `stream_type` among `changes` (the highest commit version)."""
    kept = changes.filter(pc.equal(changes["stream_type"], stream_type))
    return tables.latest_per_stream(kept, [("_commit_version", "descending")]).select(_STATE_COLUMNS)


def _current(path: str, state: DeltaTable, stream_type: str) -> pa.Table:
    rows = current.files(path, state).to_table(columns=_STATE_COLUMNS)
    return rows.filter(pc.equal(rows["stream_type"], stream_type))


def _typed(rows: pa.Table, reducer: Reducer, table: Table) -> pa.Table:
    """`stream_state` rows as the typed table's: the envelope, then the state's fields from its JSON."""
    assert reducer.state is not None
    rows = rows.filter(pc.is_valid(rows["state"]))  # none: a rebuild of the type in progress left none
    states = [json.loads(text) for text in rows["state"].to_pylist()]  # the JSON form the fold checked
    try:
        fields = state_json.columns(states, reducer.state)
    except state_json.StateMisfit as misfit:  # a row folded before its fields were checked at the fold
        raise TypedStateMismatch(reducer.stream_type, rows["stream_id"][misfit.index].as_py(), misfit.field,
                                 misfit.value, misfit.reason) from None
    envelope = rows.select(_ENVELOPE.names).cast(_ENVELOPE)
    return pa.Table.from_arrays([*envelope.columns, *fields.columns], schema=table.schema)


def table_names(warehouse: Location) -> Iterator[str]:
    """The typed state tables in the lake now (whatever the domain), by name."""
    yield from tables.table_names(warehouse, PREFIX)
