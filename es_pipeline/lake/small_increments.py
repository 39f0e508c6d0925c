"""Small increments of the projections without a JVM: Arrow, the reducers in plain Python, a delta-rs MERGE.

Spark takes seconds to fold a few dozen events (a job per step, then a MERGE); a tailing `events` run
brings that many every pass. Up to `SMALL_INCREMENT` new events, the same update is done here: the rows
that the `events` commits since the last update added (delta-rs reads Delta's change data feed, which
leaves out compaction's rewrites), aggregated by pyarrow or folded by the same `_StreamFold` the Spark
path runs on its workers, then merged by delta-rs under the same Delta transaction id (app id, version)
Spark's MERGE carries, so either engine sees what the other has folded.

One committer at a time per table: this runs inside the table's turn in the store
(`serial.one_at_a_time`), as the Spark path does, so Spark and delta-rs never commit to a projection
at once, on a local disk or on S3 (docs/decisions.md, "One committer engine per table"). Whatever this
path does not do (a first build, a reducer revision bump, a change feed vacuumed away, a larger
increment) returns None, and the caller runs the Spark path.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import CommitProperties, DeltaTable, Transaction

from es_pipeline.domain import Domain
from es_pipeline.lake import tables
from es_pipeline.lake.serial import Turn, turn_if_free
from es_pipeline.source import payloads

if TYPE_CHECKING:
    from es_pipeline.lake.projections import ProjectionResult, _Projection
    from es_pipeline.lake.stream_state import StateResult

SMALL_INCREMENT = 200_000  # new events at most; above, Spark does the update
_FOLD_COLUMNS = ["stream_id", "stream_type", "version", "event_type", "payload", "recorded_at", "tenant"]
_READ_COLUMNS = [*_FOLD_COLUMNS, "payload_encoding"]  # read; the fold gets payloads as reducers read them


def new_rows(events: DeltaTable, after: int, upto: int, columns: list[str]) -> pa.Table | None:
    """The rows that the `events` commits after..upto (inclusive) added, or None when they number more than
    `SMALL_INCREMENT` or cannot be read (their files vacuumed): then Spark takes the update."""
    try:
        feed = pa.RecordBatchReader.from_stream(events.load_cdf(
            starting_version=after + 1, ending_version=upto, columns=[*columns, "_change_type"]))
        batches, rows = [], 0
        for batch in feed:
            rows += batch.num_rows
            if rows > SMALL_INCREMENT:
                return None
            batches.append(batch)
    except Exception as exc:  # noqa: BLE001 - a vacuumed file goes to Spark's rebuild; anything else re-raises
        if tables.change_feed_gone(exc):
            return None
        raise
    table = _plain(pa.Table.from_batches(batches, schema=feed.schema))
    return table.filter(pc.equal(table["_change_type"], "insert")).select(columns)


class Feed:
    """`events`' change feed up to its version now, read once for several increments (a tailing run folds
    the three projections one after another, usually from the same version): each asks for the rows after
    its own version, in its own columns. The table's log is loaded once."""

    def __init__(self, events_path: str, columns: list[str]) -> None:
        self.table, self.columns = DeltaTable(events_path), list(dict.fromkeys(columns))
        self.version = self.table.version()
        self._after: int | None = None
        self._rows: pa.Table | None = None

    def rows(self, after: int, columns: list[str]) -> pa.Table | None:
        """The rows the commits after..version added (None: more than `SMALL_INCREMENT`, or vacuumed)."""
        if self._after is None or after < self._after:
            self._after = after
            self._rows = new_rows(self.table, after, self.version, [*self.columns, "_commit_version"])
        if self._rows is None:
            return None
        rows = self._rows
        if after > self._after:
            rows = rows.filter(pc.greater(rows["_commit_version"], after))
        return rows.select(columns)


def _plain(table: pa.Table) -> pa.Table:
    """delta-rs reads strings as `string_view`, which pyarrow's kernels do not all take: plain strings."""
    return table.cast(_plain_schema(table.schema))


def _plain_schema(schema: pa.Schema) -> pa.Schema:
    return pa.schema([pa.field(f.name, pa.string(), f.nullable) if f.type == pa.string_view() else f for f in schema])


def _files(path: str, table: DeltaTable) -> ds.Dataset:
    """The table's current Parquet files as a pyarrow dataset of one schema (plain strings)."""
    fs, _ = tables.filesystem(path)
    names = [uri.split("://", 1)[1] if "://" in uri else uri for uri in table.file_uris()]
    # One schema for every file, with plain strings: delta-rs writes string_view into its files' Arrow schema.
    return ds.dataset(names, format="parquet", filesystem=fs, schema=_plain_schema(pa.schema(table.schema().to_arrow())))


def _row_count(table: DeltaTable) -> int:
    adds = pa.table(table.get_add_actions(flatten=True))
    return int(pc.sum(adds["num_records"]).as_py() or 0) if adds.num_rows else 0


def _commit_properties(app_id: str, version: int) -> CommitProperties:
    return CommitProperties(app_transactions=[Transaction(app_id, version)])


def update_projection(
    projection: _Projection, warehouse: tables.Location, turn: Turn, feed: Feed | None = None
) -> ProjectionResult | None:
    """An additive projection's increment, aggregated by pyarrow and merged by delta-rs; None: not here.
    `feed`: `events`' change feed shared with other increments (else read here)."""
    from es_pipeline.lake.projections import ProjectionResult

    events_path = tables.table_path(warehouse, "events")
    path = tables.table_path(warehouse, projection.name)
    if not tables.is_delta_table(path) or not tables.is_delta_table(events_path):
        return None
    target = DeltaTable(path)
    prev = target.transaction_version(projection.app_id)
    if prev is None or not tables.has_columns(target, projection.key):
        return None  # a first build, or a table of an older es_pipeline: Spark builds it whole
    feed = feed or Feed(events_path, list(projection.columns))
    now = feed.version
    if prev >= now:
        return ProjectionResult(_row_count(target), now, int(prev), 0, 0)
    rows = feed.rows(int(prev), list(projection.columns))
    if rows is None:
        return None
    agg = projection.aggregate_arrow(rows)
    turn.confirm(path, projection.app_id, int(prev))
    if agg.num_rows:
        target.merge(agg, predicate=" AND ".join(f"t.{k} = u.{k}" for k in projection.key), source_alias="u",
                     target_alias="t", commit_properties=_commit_properties(projection.app_id, now)) \
            .when_matched_update(projection.updates).when_not_matched_insert_all().execute()
    else:  # nothing added (only compaction since): record the version all the same
        target.create_write_transaction([], mode="append", schema=target.schema(),
                                        commit_properties=_commit_properties(projection.app_id, now))
    target.update_incremental()
    return ProjectionResult(_row_count(target), now, int(prev), rows.num_rows, agg.num_rows)


def update_stream_state(
    warehouse: tables.Location, domain: Domain, skip_unknown: bool, turn: Turn, feed: Feed | None = None
) -> StateResult | None:
    """`stream_state`'s increment folded here and merged by delta-rs; None: not here (see the module).
    `feed`: `events`' change feed shared with other increments (else read here)."""
    from es_pipeline.lake import stream_state as st

    events_path = tables.table_path(warehouse, "events")
    state_path = tables.table_path(warehouse, "stream_state")
    if not tables.is_delta_table(state_path) or not tables.is_delta_table(events_path):
        return None
    state = DeltaTable(state_path)
    read = state.transaction_version(st.APP_ID)
    if read is None or not tables.has_columns(state, st.KEY):
        return None  # a first build, or a table made before tenants: Spark adds the column
    prev = int(read) // st._REVISION_SLOTS
    feed = feed or Feed(events_path, _READ_COLUMNS)
    now = feed.version
    if "deletionVectors" in (state.protocol().writer_features or []):
        return None  # its files alone are not its rows
    if prev >= now:  # nothing new; a reducer revision bump changes the txn version, and Spark rebuilds those types
        return st.StateResult(now, prev, 0, 0, (), 0, 0) if st.txn_version(now, domain.reducers) == int(read) else None
    read_rows = feed.rows(prev, _READ_COLUMNS)
    if read_rows is None:
        return None
    new = payloads.for_reducers(tables.tenant_filled(read_rows))
    # Read once, whole, and filtered here: pyarrow's pushdown fails on the string_view statistics delta-rs writes.
    whole = _files(state_path, state).to_table()
    kinds = whole.select(["stream_type", "revision"]).group_by(["stream_type", "revision"]).aggregate([])
    if st.stale_types(zip(kinds["stream_type"].to_pylist(), kinds["revision"].to_pylist(), strict=True), domain):
        return None  # a reducer added, bumped or removed: Spark rebuilds those types
    prior = whole.filter(pc.or_(pc.is_in(whole["stream_id"], pc.unique(new["stream_id"])),
                                pc.is_valid(whole["parked"])))
    rows = _fold_input(new, prior)
    out = pa.Table.from_batches(list(st._fold_partitions(dict(domain.reducers), skip_unknown)(rows.to_batches())),
                                schema=st._fold_out_arrow_schema())
    updates = st.arrow_updates(out)
    turn.confirm(state_path, st.APP_ID, int(read))
    state.merge(updates, predicate=" AND ".join(f"t.{k} = u.{k}" for k in st.KEY), source_alias="u", target_alias="t",
                commit_properties=_commit_properties(st.APP_ID, st.txn_version(now, domain.reducers))) \
        .when_matched_update_all().when_not_matched_insert_all().execute()
    return st.arrow_result(out, now, prev)


def _fold_input(new: pa.Table, prior: pa.Table) -> pa.Table:
    """The fold's rows, as the Spark path builds them: new events, the parked ones, and each touched
    stream's prior row (its state in `payload`, marked `is_prior`), sorted by stream, prior first, version."""
    schema = pa.schema([("stream_id", pa.string()), ("stream_type", pa.string()), ("version", pa.int32()),
                        ("event_type", pa.string()), ("payload", pa.string()),
                        ("recorded_at", pa.timestamp("us", tz="UTC")), ("tenant", pa.string()),
                        ("prior_skipped", pa.int32()), ("is_prior", pa.bool_())])
    events = new.cast(pa.schema([schema.field(c) for c in _FOLD_COLUMNS]))
    n = events.num_rows
    parts = [events.append_column("prior_skipped", pa.nulls(n, pa.int32()))
             .append_column("is_prior", pa.array([False] * n))]
    p = prior.to_pydict()
    parked: list[tuple[Any, ...]] = []
    for tenant, sid, stype, text in zip(p["tenant"], p["stream_id"], p["stream_type"], p["parked"], strict=True):
        for e in json.loads(text) if text else ():
            at = None if e["recorded_at"] is None else datetime.fromisoformat(str(e["recorded_at"]))
            parked.append((sid, stype, e["version"], e["event_type"], e["payload"],
                           at if at is None or at.tzinfo else at.replace(tzinfo=UTC), tenant, None, False))
    if parked:
        parts.append(pa.Table.from_pylist([dict(zip(schema.names, r, strict=True)) for r in parked], schema=schema))
    # Prior rows of the touched streams' ids (of any tenant: a superset, folded unchanged if untouched).
    touched = set(events["stream_id"].to_pylist()) | {r[0] for r in parked}
    keep = pc.is_in(prior["stream_id"], pa.array(sorted(touched), pa.string()))
    had = prior.filter(keep)
    parts.append(pa.table({
        "stream_id": had["stream_id"], "stream_type": had["stream_type"], "version": had["version"],
        "event_type": pa.nulls(had.num_rows, pa.string()), "payload": had["state"],
        "recorded_at": had["last_event_at"], "tenant": had["tenant"], "prior_skipped": had["skipped"],
        "is_prior": pa.array([True] * had.num_rows),
    }, schema=schema))
    rows = pa.concat_tables([t.cast(schema) for t in parts])
    return rows.sort_by([("tenant", "ascending"), ("stream_id", "ascending"), ("is_prior", "descending"),
                         ("version", "ascending")])


def follow(
    warehouse: tables.Location, store: str | psycopg.Connection, domain: Domain
) -> dict[str, ProjectionResult | StateResult]:
    """Every projection's small increment now, each in its turn (a tailing `events` run keeps them fresh
    this way), from one read of `events`' change feed. A projection whose turn another update holds, or
    that needs Spark, is left out: its automation's run does it. `store`: the store's DSN, or a
    `lock_transaction` connection kept for the turns."""
    from es_pipeline.lake.projections import EVENT_TYPE_DAILY, STREAM_CATALOG

    events_path = tables.table_path(warehouse, "events")
    if not tables.is_delta_table(events_path):
        return {}
    feed = Feed(events_path, [*_READ_COLUMNS, *STREAM_CATALOG.columns, *EVENT_TYPE_DAILY.columns])
    done: dict[str, ProjectionResult | StateResult] = {}
    with turn_if_free(store, "stream_state") as turn:
        state = update_stream_state(warehouse, domain, False, turn, feed) if turn is not None else None
        if state is not None:
            done["stream_state"] = state
    for projection in (STREAM_CATALOG, EVENT_TYPE_DAILY):
        with turn_if_free(store, projection.name) as turn:
            result = update_projection(projection, warehouse, turn, feed) if turn is not None else None
            if result is not None:
                done[projection.name] = result
    return done
