"""`stream_state`: one row per stream, folded incrementally from `events` by the reducers (Spark).

Each run folds only what is new since the last run: the rows that the Delta commits of `events`
after the last processed table version added (read through Delta's change data feed, so the cost
follows the increment, not the table), onto the previous state of the streams they touch, in
version order: the rows are partitioned by stream and sorted, and a `mapInArrow` function folds
them in one pass per partition on the Python workers (plain Python per event, Arrow in and out;
nothing goes through the driver, and no pandas frame is built per stream). The events table version processed is committed atomically with the
state, as the MERGE's Delta transaction id (`txnAppId`/`txnVersion`), so a crash or a retry never
folds an event twice.

A stream's versions can reach the lake out of order (two transactions whose xids are in the other
order than their commits), so only the contiguous run after the folded version is applied; later
events wait in the row's `parked` column, and are folded when the gap fills.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import repeat
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from es_pipeline.domain import Domain, Event, Reducer, UnknownEventType
from es_pipeline.errors import ReducerError
from es_pipeline.lake import small_increments as small
from es_pipeline.lake import tables, whole_fold
from es_pipeline.lake.serial import Turn, one_at_a_time
from es_pipeline.lake.tables import Location

APP_ID = "es_pipeline.stream_state"

# Keyed by (tenant, stream_id); `tenant` last, where a table of a release before tenants takes it.
STATE_DDL = (
    "stream_id STRING, stream_type STRING, version INT, state STRING, last_event_at TIMESTAMP, "
    "revision INT, parked STRING, skipped INT, updated_at TIMESTAMP, tenant STRING"
)
KEY = ("tenant", "stream_id")
_FOLD_OUT = (
    "stream_id STRING, stream_type STRING, version INT, state STRING, last_event_at TIMESTAMP, "
    "revision INT, parked STRING, skipped INT, folded INT, error STRING, tenant STRING"
)
_PARKED_SCHEMA = "ARRAY<STRUCT<version: INT, event_type: STRING, payload: STRING, recorded_at: TIMESTAMP>>"


@dataclass(frozen=True)
class StateResult:
    events_version: int
    previous_events_version: int
    events_folded: int
    streams_updated: int
    rebuilt_types: tuple[str, ...]
    parked_streams: int
    skipped_unknown: int
    without_reducer: int = 0  # streams of this run's rows whose type has no reducer (their row has no state)


# The Delta txn version of a stream_state commit encodes the events table version folded and the
# sum of the reducer revisions, so that a revision bump with no new events still commits (Delta
# skips a txn version it has seen) while a replay of the same work does not.
_REVISION_SLOTS = 1000


def folded_version(state_path: str) -> tuple[int, int] | None:
    """(stream_state's Delta version, the `events` version it has folded up to), read from one version of
    its log; None before its first update."""
    if not tables.is_delta_table(state_path):
        return None
    table = DeltaTable(state_path)
    read = table.transaction_version(APP_ID)
    return None if read is None else (int(table.version()), int(read) // _REVISION_SLOTS)


def txn_version(events_version: int, registry: dict[str, Reducer]) -> int:
    return events_version * _REVISION_SLOTS + min(_REVISION_SLOTS - 1, sum(r.revision for r in registry.values()))


def next_txn_version(events_version: int, registry: dict[str, Reducer], read: int | None) -> int:
    """The txn version of a commit at `events_version` after one of txn version `read`: `txn_version`, unless that
    is not above `read` at the same events version (a reducer removed: the sum went down, and Delta would skip the
    commit as done), then one above `read`, within that events version's slots."""
    version = txn_version(events_version, registry)
    if read is not None and version <= read and read // _REVISION_SLOTS == events_version:
        version = min(read + 1, events_version * _REVISION_SLOTS + _REVISION_SLOTS - 1)
    return version


def txn_version_after(read: int, events_version: int) -> int:
    """The txn version of a commit at `events_version` by the reducers that committed txn version `read`."""
    return events_version * _REVISION_SLOTS + read % _REVISION_SLOTS


def _loads(text: str) -> Any:
    """A payload or a state as the reducers read it: orjson, or json for what orjson refuses (integers past
    64 bits, NaN), so that both take the same documents and a bad one fails as json's error."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_new_event = tuple.__new__  # Event(...) without its Python-level __new__: one per event folded


def _timestamp(micros: int | None) -> datetime | None:
    return None if micros is None else _EPOCH + timedelta(microseconds=micros)


class _StreamFold:
    """One stream's fold within a partition: its prior row (if any), then its events in version order.
    Times travel as microseconds since the epoch (a datetime per event would cost as much as the fold)."""

    __slots__ = ("tenant", "stream_id", "stream_type", "reducer", "fold", "skip_unknown", "state", "version",
                 "last_at", "skipped", "folded", "parked", "error")

    def __init__(
        self, tenant: str, stream_id: str, stream_type: str, reducer: Reducer | None, skip_unknown: bool
    ) -> None:
        self.tenant, self.stream_id, self.stream_type = tenant, stream_id, stream_type
        self.reducer, self.skip_unknown = reducer, skip_unknown
        self.fold = reducer.fold if reducer is not None else None  # None: no state, the versions alone
        self.state: dict[str, Any] = {}
        self.version = 0
        self.last_at: int | None = None
        self.skipped = 0
        self.folded = 0
        self.parked: list[dict[str, Any]] = []
        self.error: str | None = None

    def prior(self, state: str | None, version: int, last_at: int | None, skipped: int | None) -> None:
        self.state = _loads(state) if state is not None and self.fold is not None else {}
        self.version, self.last_at, self.skipped = version, last_at, skipped or 0

    def event(self, v: int, event_type: str, payload: str, recorded_at: int | None) -> None:
        """Fold one event, or park it (a gap before it), or pass it by (folded already, or after an error).
        Run for every event of a rebuild: the next version of a stream with nothing parked goes straight on."""
        if v != self.version + 1 or self.parked or self.error is not None:
            self._off_the_run(v, event_type, payload, recorded_at)
            return
        if self.fold is None:  # no reducer: the stream's versions and times alone
            self.version, self.last_at = v, recorded_at
            self.folded += 1
            return
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            data = json.loads(payload)  # what orjson refuses (integers past 64 bits, NaN); a bad payload fails here
        try:
            self.state = self.fold(self.state, _new_event(Event, (self.stream_id, v, event_type, data)))
        except Exception as exc:  # noqa: BLE001 - any reducer failure is reported, with its place
            if not self._failed(exc, v, event_type):
                return
        self.version, self.last_at = v, recorded_at
        self.folded += 1

    def events(self, run: Iterator[tuple[int, str, str, int | None]]) -> None:
        """Every event of `run` (this stream's, in version order) as `event` folds them, the stream's figures
        kept in locals while each event is the next version (a first build's every event but a gap's)."""
        if not self.parked and self.error is None and self.fold is None:
            version, last_at, folded = self.version, self.last_at, self.folded
            for v, event_type, payload, recorded_at in run:
                if v != version + 1:
                    self.version, self.last_at, self.folded = version, last_at, folded
                    self.event(v, event_type, payload, recorded_at)
                    break
                version, last_at, folded = v, recorded_at, folded + 1
            else:
                self.version, self.last_at, self.folded = version, last_at, folded
        elif not self.parked and self.error is None:
            state, version, last_at, folded = self.state, self.version, self.last_at, self.folded
            fold, stream_id = self.fold, self.stream_id
            assert fold is not None
            off: tuple[int, str, str, int | None] | None = None
            for v, event_type, payload, recorded_at in run:
                if v != version + 1:
                    off = (v, event_type, payload, recorded_at)
                    break
                try:
                    data = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    data = json.loads(payload)
                try:
                    state = fold(state, _new_event(Event, (stream_id, v, event_type, data)))
                except Exception as exc:  # noqa: BLE001 - as in `event`
                    if not self._failed(exc, v, event_type):
                        break
                version, last_at, folded = v, recorded_at, folded + 1
            self.state, self.version, self.last_at, self.folded = state, version, last_at, folded
            if off is not None:
                self.event(*off)
        for rest in run:  # after a gap or an error: one by one
            self.event(*rest)

    def _failed(self, exc: Exception, v: int, event_type: str) -> bool:
        """A reducer's failure on event `v`: True if the event is skipped (an unknown type, skipped by
        policy: the stream goes on past it), else False with the stream's error set (it stops there)."""
        if isinstance(exc, UnknownEventType):
            if self.skip_unknown:
                self.skipped += 1
                return True
            reason = str(exc)
        elif isinstance(exc, KeyError):
            reason = f"the payload has no field {exc}"
        else:
            reason = f"{type(exc).__name__}: {exc}"
        self.error = json.dumps([self.stream_id, v, event_type, reason])
        return False

    def _off_the_run(self, v: int, event_type: str, payload: str, recorded_at: int | None) -> None:
        if self.error is not None or v <= self.version or (self.parked and self.parked[-1]["version"] >= v):
            return  # after an error, or already folded, or a duplicate of a parked event
        self.parked.append({"version": v, "event_type": event_type, "payload": payload,
                            "recorded_at": _timestamp(recorded_at)})

    def row(self) -> tuple[Any, ...]:
        return (
            self.stream_id, self.stream_type, self.version,
            None if self.fold is None else json.dumps(self.state, sort_keys=True, separators=(",", ":")), self.last_at,
            self.reducer.revision if self.reducer else 0,
            json.dumps(self.parked, default=str) if self.parked else None,
            self.skipped, self.folded, self.error, self.tenant,
        )


_OUT_BATCH_ROWS = 5_000
_IN_COLUMNS = ("stream_id", "tenant", "stream_type", "version", "event_type", "payload", "is_prior", "prior_skipped")


def _fold_partitions(registry: dict[str, Reducer], skip_unknown: bool):  # type: ignore[no-untyped-def]
    """The fold as a `mapInArrow` function, shipped to the Python workers with the reducers captured.

    Its input is partitioned by stream and sorted by (stream, prior row first, version), so one
    pass over the Arrow batches meets each stream's rows together, in order: plain Python per
    event, one Arrow batch out per few thousand streams (no pandas frame per stream).
    """

    def run(batches):  # type: ignore[no-untyped-def]
        schema = _fold_out_arrow_schema()
        out: list[tuple[Any, ...]] = []
        current: _StreamFold | None = None
        sid_now = tenant_now = None

        def flush() -> Any:
            batch = fold_out_batch(out, schema)
            out.clear()
            return batch

        for batch in batches:
            n = batch.num_rows
            at = batch.column("recorded_at").cast(pa.int64()).to_pylist()
            # A batch without the prior-row columns (lake/whole_fold.py: no state yet) has only events.
            columns = [batch.column(name).to_pylist() if name in batch.schema.names else repeat(None, n)
                       for name in _IN_COLUMNS]
            for sid, tenant, stype, version, event_type, payload, is_prior, prior_skipped, recorded_at in zip(
                *columns, at, strict=True
            ):
                if sid != sid_now or tenant != tenant_now:
                    if current is not None:
                        out.append(current.row())
                        if len(out) >= _OUT_BATCH_ROWS:
                            yield flush()
                    sid_now, tenant_now = sid, tenant
                    current = _StreamFold(tenant, sid, stype, registry.get(stype), skip_unknown)
                    fold_event = current.event
                if is_prior:
                    current.prior(payload, version, recorded_at, prior_skipped)  # type: ignore[union-attr]
                else:
                    fold_event(version, event_type, payload, recorded_at)
        if current is not None:
            out.append(current.row())
        if out:
            yield flush()

    return run


def fold_out_batch(rows: list[tuple[Any, ...]], schema: pa.Schema) -> pa.RecordBatch:
    """The rows of `_StreamFold.row` as one Arrow batch of the fold's output schema."""
    columns = list(zip(*rows, strict=True))
    return pa.RecordBatch.from_arrays(
        [pa.array(list(col), type=f.type) for col, f in zip(columns, schema, strict=True)], schema=schema)


def _fold_out_arrow_schema() -> Any:
    return pa.schema([
        ("stream_id", pa.string()), ("stream_type", pa.string()), ("version", pa.int32()), ("state", pa.string()),
        ("last_event_at", pa.timestamp("us", tz="UTC")), ("revision", pa.int32()), ("parked", pa.string()),
        ("skipped", pa.int32()), ("folded", pa.int32()), ("error", pa.string()), ("tenant", pa.string()),
    ])


def arrow_updates(out: pa.Table) -> pa.Table:
    """The rows to commit from a fold done in this process (the small increment's, the first build's): its
    first error raised as `ReducerError`, else its rows without the fold's own columns, stamped now."""
    errors = pc.drop_null(out["error"])
    if len(errors):
        stream_id, version, event_type, reason = json.loads(pc.min(errors).as_py())
        raise ReducerError(stream_id, version, event_type, reason)
    return out.drop_columns(["error", "folded"]).append_column(
        "updated_at", pa.array([datetime.now(UTC)] * out.num_rows, pa.timestamp("us", tz="UTC")))


def arrow_result(out: pa.Table, events_version: int, previous: int) -> StateResult:
    """The figures of a fold done in this process."""
    parked = int(pc.sum(pc.is_valid(out["parked"])).as_py() or 0)
    without = int(pc.sum(pc.equal(out["revision"], 0)).as_py() or 0)
    return StateResult(events_version, previous, int(pc.sum(out["folded"]).as_py() or 0), out.num_rows, (), parked,
                       int(pc.sum(out["skipped"]).as_py() or 0), without)


def stale_types(kinds: Any, domain: Domain) -> list[str]:
    """The stream types of (stream_type, revision) pairs that `stream_state` holds whose reducer's revision is no
    longer the row's: a bumped, added (rows of revision 0) or removed reducer (rows of its revision, now none).
    They are rebuilt from `events`, each type alone."""
    revisions = domain.revisions()
    return sorted({t for t, r in kinds if revisions.get(t, 0) != (r or 0)})


def update_stream_state(
    spark: Any, warehouse: Location, *, domain: Domain, skip_unknown: bool = False, store_dsn: str | None = None,
    small_increments: bool = True,
) -> StateResult:
    """Fold the events of the `events` commits since the last update onto `stream_state` (module docstring);
    with `store_dsn`, one update at a time. `spark`: a session, or a function that returns one, called only
    if Spark is needed: a small increment (lake/small_increments.py) and a first build of a lake that fits
    (lake/whole_fold.py) are folded without a JVM unless told not to."""
    with one_at_a_time(store_dsn, "stream_state") as turn:
        if small_increments:
            done = small.update_stream_state(warehouse, domain, skip_unknown, turn) or whole_fold.first_build(
                warehouse, domain, skip_unknown, turn)
            if done is not None:
                return done
        spark = tables.session_of(spark)
        try:
            return _update_stream_state(spark, warehouse, domain, skip_unknown, turn)
        except tables.spark_errors() as exc:
            if not tables.change_feed_gone(exc):
                raise
            # The files of the commits since the last update were vacuumed (it lagged past the retention):
            # fold every event instead; the fold skips versions a stream's state already has.
            return _update_stream_state(spark, warehouse, domain, skip_unknown, turn, whole=True)


def _update_stream_state(
    spark: Any, warehouse: Location, domain: Domain, skip_unknown: bool, turn: Turn, *, whole: bool = False
) -> StateResult:
    from pyspark.sql import functions as F

    events_path = tables.table_path(warehouse, "events")
    state_path = tables.table_path(warehouse, "stream_state")
    tables.ensure_table(spark, state_path, STATE_DDL, comment="es_pipeline: current state per stream")
    if not tables.has_columns(state_path, ["tenant"]):  # made before tenants: every row is of no tenant ('')
        spark.sql(f"ALTER TABLE delta.`{state_path}` ADD COLUMNS (tenant STRING)")
        spark.sql(f"UPDATE delta.`{state_path}` SET tenant = '' WHERE tenant IS NULL")
    now = tables.table_version(spark, events_path)
    read = tables.transaction_version(state_path, APP_ID)
    prev = -1 if read is None else read // _REVISION_SLOTS
    state = tables.read(spark, state_path)
    stale = stale_types(state.select("stream_type", "revision").distinct().collect(), domain)
    # Payloads as reducers read them: JSON as is, base64 or text wrapped as {"base64": …} (source/payloads.py).
    enc = F.col("payload_encoding")
    cols = ["stream_id", "stream_type", "version", "event_type",
            F.when(enc.isNull() | (enc == "json"), F.col("payload"))
            .otherwise(F.to_json(F.create_map(enc, F.col("payload")))).alias("payload"), "recorded_at",
            F.coalesce(F.col("tenant"), F.lit("")).alias("tenant")]
    if prev < 0 or (whole and prev < now):
        new = tables.read(spark, events_path, version=now).select(*cols)
    elif prev < now:
        new = tables.rows_added(spark, events_path, prev, now).select(*cols)
    else:
        new = None
    if stale:
        rebuild = tables.read(spark, events_path, version=now) \
            .where(F.col("stream_type").isin(stale)).select(*cols)
        new = rebuild if new is None else new.where(~F.col("stream_type").isin(stale)).unionByName(rebuild)
    if new is None:
        return StateResult(now, prev, 0, 0, (), 0, 0)

    prior = state.where(~F.col("stream_type").isin(stale)) if stale else state
    parked = (
        prior.where("parked IS NOT NULL")
        .select("tenant", "stream_id", "stream_type", F.explode(F.from_json("parked", _PARKED_SCHEMA)).alias("p"))
        .select("stream_id", "stream_type", "p.version", "p.event_type", "p.payload", "p.recorded_at", "tenant")
    )
    todo = new.unionByName(parked)
    touched = todo.select(*KEY).distinct()
    # The prior row of each touched stream travels with its events, marked and sorted first: its
    # state in `payload`, its version and last event time in theirs.
    prior_rows = prior.join(touched, list(KEY), "left_semi").select(
        "stream_id", "stream_type", "version", F.lit(None).cast("string").alias("event_type"),
        F.col("state").alias("payload"), F.col("last_event_at").alias("recorded_at"), "tenant",
        F.col("skipped").alias("prior_skipped"), F.lit(True).alias("is_prior"),
    )
    rows = todo.withColumn("prior_skipped", F.lit(None).cast("int")).withColumn("is_prior", F.lit(False)) \
        .unionByName(prior_rows)
    folded = (
        rows.repartition(*KEY)
        .sortWithinPartitions(*KEY, F.col("is_prior").desc(), "version")
        .mapInArrow(_fold_partitions(dict(domain.reducers), skip_unknown), _FOLD_OUT)
        .cache()
    )
    try:
        # One action computes the fold (cached) and its figures; the first error, if any, is in it.
        stats = folded.agg(
            F.count("*").alias("streams"), F.sum(F.when(F.col("parked").isNotNull(), 1).otherwise(0)).alias("parked"),
            F.sum("skipped").alias("skipped"), F.sum("folded").alias("folded"), F.min("error").alias("error"),
            F.sum(F.when(F.col("revision") == 0, 1).otherwise(0)).alias("without_reducer"),
        ).first()
        if stats["error"] is not None:
            stream_id, version, event_type, reason = json.loads(stats["error"])
            raise ReducerError(stream_id, version, event_type, reason)
        n_events = stats["folded"] or 0
        updates = folded.drop("error", "folded").withColumn("updated_at", F.current_timestamp())
        turn.confirm(state_path, APP_ID, read)
        tables.merge_by_key(spark, state_path, updates, KEY, app_id=APP_ID, version=next_txn_version(now, domain.reducers, read))
    finally:
        folded.unpersist()
    return StateResult(now, prev, int(n_events), int(stats["streams"] or 0), tuple(stale),
                       int(stats["parked"] or 0), int(stats["skipped"] or 0), int(stats["without_reducer"] or 0))
