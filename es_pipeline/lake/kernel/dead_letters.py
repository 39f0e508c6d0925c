"""`_dead_letters`: one row per quarantined stream or cross-stream key, in the lake (docs/decisions/0051).

A fold that cannot take an event holds that stream (or key) at its last good state, marked `quarantined` in its
own table, and every other stream goes on. This table lists them in one place, for the operator (`es-pipeline lake
quarantined`), the exporter (`es_pipeline_quarantined`, and its alert) and the analysts: the table, tenant, stream
(or key), the failing event's version and type, the error's kind and message, since when, and how many retries
failed since.

Its rows of a table are a function of that table's own rows: `replace` makes them so after each update of the
table, in the table's turn, from what the table says now. So a crash between the table's commit and this one
leaves nothing wrong for long: the next update (also one that finds nothing new) writes them. The message is the
team's (it may quote a payload): it stays here and in the run's log, never in a metric, a label or a webhook.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError

from es_pipeline.domain import UTC_MICROS
from es_pipeline.lake.delta import current, tables
from es_pipeline.lake.delta.definition import Table
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.kernel import position

log = logging.getLogger(__name__)

NAME = "_dead_letters"
COLUMNS = pa.schema([
    ("table_name", pa.string()),  # the table the stream or key is quarantined in
    ("tenant", pa.string()),
    ("key", pa.string()),  # the stream's id (stream_state), or the cross-stream projection's key (null: none)
    ("stream_id", pa.string()),  # the failing event's stream
    ("stream_type", pa.string()),
    ("version", pa.int64()),  # the failing event's version in its stream
    ("event_type", pa.string()),
    ("error_kind", pa.string()),  # the exception's class: KeyError, UnknownEventType, StateMisfit, ...
    ("message", pa.string()),  # the team's message: in the lake and the run's log only
    ("first_seen", UTC_MICROS),  # when this event first failed
    ("retries", pa.int32()),  # updates that refolded it since, and failed again
])
DEAD_LETTERS = Table(NAME, pa.schema([*COLUMNS, pa.field("updated_at", UTC_MICROS)]),
                     key=("table_name", "tenant", "key"), comment="quarantined streams and keys (docs/operations.md)")
_ATTEMPTS = 8


def _app(table_name: str, source_id: str) -> str:
    """The app id a version of `table_name` (the Delta table of id `source_id`: a table made anew has another) is
    recorded under."""
    return f"es_pipeline.{NAME}/{table_name}@{source_id}"


def written_for(warehouse: Location, table_name: str, source_id: str) -> int | None:
    """The version of `table_name` (of Delta id `source_id`) whose quarantined rows `_dead_letters` holds now (None:
    none recorded)."""
    path = DEAD_LETTERS.path(warehouse)
    if not tables.is_delta_table(path):
        return None
    read = DeltaTable(path).transaction_version(_app(table_name, source_id))
    return None if read is None else int(read)


def rows_of(warehouse: Location, table_name: str | None = None) -> pa.Table:
    """`_dead_letters`' rows (of `table_name`; every table's without), by table, tenant and key."""
    path = DEAD_LETTERS.path(warehouse)
    if not tables.is_delta_table(path):
        return DEAD_LETTERS.schema.empty_table()
    rows = current.files(path, DeltaTable(path)).to_table()
    if table_name is not None:
        rows = rows.filter(pc.equal(rows["table_name"], table_name))
    return rows.sort_by([("table_name", "ascending"), ("tenant", "ascending"), ("key", "ascending")])


def counts(warehouse: Location, *, keyless: bool = False) -> dict[str, int]:
    """Quarantined streams or keys per table (`keyless`: instead, the events whose key function failed, which no
    row holds: a new revision of the projection folds them again)."""
    rows = rows_of(warehouse)
    rows = rows.filter(pc.is_null(rows["key"]) if keyless else pc.is_valid(rows["key"])).select(["table_name"])
    if not rows.num_rows:
        return {}
    grouped = rows.group_by("table_name").aggregate([("table_name", "count")])
    return dict(zip(grouped["table_name"].to_pylist(), grouped["table_name_count"].to_pylist(), strict=True))


def _write(warehouse: Location, table_name: str, rows: pa.Table, at: tuple[str, int] | None) -> None:
    """`_dead_letters`' rows of `table_name` overwritten by `rows`, with `at` (source id, version) recorded."""
    path = DEAD_LETTERS.path(warehouse)
    DEAD_LETTERS.ensure_arrow(warehouse)
    stamped = rows.append_column("updated_at", pa.array([datetime.now(UTC)] * rows.num_rows, UTC_MICROS))
    props = None if at is None else position.commit_properties(_app(table_name, at[0]), at[1])
    for attempt in range(_ATTEMPTS):
        try:
            write_deltalake(path, stamped, mode="overwrite", predicate=f"table_name = '{table_name}'",
                            commit_properties=props)
            return
        except CommitFailedError:  # another table's rows written meanwhile (each table's only in its own turn)
            log.info("%s: a concurrent commit; writing the rows of %s again (attempt %d)", NAME, table_name, attempt + 2)
            time.sleep(0.05 * (attempt + 1))
    raise RuntimeError(f"{NAME}: could not write the rows of {table_name} in {_ATTEMPTS} attempts")


def replace(warehouse: Location, table_name: str, rows: pa.Table, source_id: str, source_version: int) -> int:
    """Make `_dead_letters`' rows of `table_name` be `rows` (of `COLUMNS`): what that table (of Delta id `source_id`)
    says at its Delta version `source_version`. Written only where they differ, with `source_version` recorded (an
    older version than the one recorded is not written: a later update wrote already). How many rows it has there."""
    path = DEAD_LETTERS.path(warehouse)
    rows = rows.cast(COLUMNS).sort_by([("tenant", "ascending"), ("key", "ascending")])
    if not tables.is_delta_table(path):
        if rows.num_rows:
            _write(warehouse, table_name, rows, (source_id, source_version))
        return rows.num_rows  # none: nothing quarantined, and never was, so no table
    table = DeltaTable(path)
    recorded = table.transaction_version(_app(table_name, source_id))
    if recorded is not None and recorded >= source_version:
        return rows.num_rows
    held = current.files(path, table).to_table()
    held = held.filter(pc.equal(held["table_name"], table_name)).drop_columns(["updated_at"]) \
        .sort_by([("tenant", "ascending"), ("key", "ascending")])
    if not held.equals(rows):
        _write(warehouse, table_name, rows, (source_id, source_version))
    return rows.num_rows


def add(warehouse: Location, table_name: str, keyless: pa.Table) -> None:
    """`keyless` (rows of `COLUMNS` without a key: events a key function failed on, which no row of the table can
    hold) added to `_dead_letters` before the table's commit that passes them by: a crash between leaves them listed
    (the next update folds the same events and finds the same rows), never lost."""
    if not keyless.num_rows:
        return
    held = rows_of(warehouse, table_name).drop_columns(["updated_at"])
    new = keyless.cast(COLUMNS)
    seen = set(zip(*(held[c].to_pylist() for c in ("tenant", "stream_id", "version")), strict=True)) \
        if held.num_rows else set()
    fresh = new.filter(pa.array([(t, s, v) not in seen for t, s, v in zip(
        *(new[c].to_pylist() for c in ("tenant", "stream_id", "version")), strict=True)], pa.bool_()))
    if fresh.num_rows:
        _write(warehouse, table_name, pa.concat_tables([held.cast(COLUMNS), fresh]), None)


def _quarantined_rows(path: str, table: DeltaTable, columns: list[str]) -> pa.Table:
    """The table's rows with `quarantined` set, in `columns`."""
    if current.has_deletion_vectors(table):  # its files alone are not its rows: DataFusion honours the vectors
        from deltalake import QueryBuilder

        return current.plain(pa.RecordBatchReader.from_stream(QueryBuilder().register("t", table).execute(
            f"SELECT {', '.join(columns)} FROM t WHERE quarantined IS NOT NULL")).read_all())
    rows = current.files(path, table).to_table(columns=columns)
    return rows.filter(pc.is_valid(rows["quarantined"]))


# (warehouse, table, table id) → the version of the table whose rows this process found `_dead_letters` to hold: a
# tailing run's follow that finds nothing new reads nothing then (a table's quarantined column is read at most once
# per version and process).
_FOLLOWED: dict[tuple[str, str, str], int] = {}


def follow(warehouse: Location, table_name: str, key_column: str, *, keyless: pa.Table | None = None,
           held: pa.Table | None = None) -> None:
    """`_dead_letters`' rows of `table_name` made its quarantined rows as it stands, and the rows without a key
    (events a key function failed on): `keyless` (a whole build found these), else those listed already. `held`: the
    table's quarantined rows (tenant, key column, [stream_type,] quarantined), where the caller knows them (an
    increment that read the table whole), else read here: only where the table moved since they were written.
    Called after each update of the table, in its turn."""
    path = tables.table_path(warehouse, table_name)
    if not tables.is_delta_table(path):
        return
    table = DeltaTable(path)
    version, source_id = int(table.version()), str(table.metadata().id)
    memo = (str(warehouse), table_name, source_id)
    if not tables.has_columns(table, ["quarantined"]) or (keyless is None and held is None and (
            _FOLLOWED.get(memo) == version or written_for(warehouse, table_name, source_id) == version)):
        return
    typed = tables.has_columns(table, ["stream_type"])
    columns = ["tenant", key_column, *(["stream_type"] if typed else []), "quarantined"]
    if held is None:
        held = _quarantined_rows(path, table, columns)
    said = [json.loads(q) for q in held["quarantined"].to_pylist()]
    keys = held[key_column].to_pylist()
    rows = pa.table({
        "table_name": pa.array([table_name] * held.num_rows, pa.string()),
        "tenant": pc.fill_null(held["tenant"], ""), "key": pa.array(keys, pa.string()),
        "stream_id": pa.array([q.get("stream_id", k) for q, k in zip(said, keys, strict=True)], pa.string()),
        "stream_type": held["stream_type"] if typed else pa.nulls(held.num_rows, pa.string()),
        "version": pa.array([q.get("version") for q in said], pa.int64()),
        "event_type": pa.array([q.get("event_type") for q in said], pa.string()),
        "error_kind": pa.array([q.get("kind") for q in said], pa.string()),
        "message": pa.array([q.get("message") for q in said], pa.string()),
        "first_seen": pa.array([datetime.fromisoformat(q["since"]) if q.get("since") else None for q in said],
                               UTC_MICROS),
        "retries": pa.array([q.get("retries", 0) for q in said], pa.int32()),
    }).cast(COLUMNS)
    if keyless is None:
        listed = rows_of(warehouse, table_name)
        keyless = listed.filter(pc.is_null(listed["key"])).drop_columns(["updated_at"])
    rows = pa.concat_tables([rows, keyless.cast(COLUMNS)])
    replace(warehouse, table_name, rows, source_id, version)
    _FOLLOWED[memo] = version
