"""Rebuilds beside the live table: a stream type whose fold changed is built again next to `stream_state` and
swapped into it in one commit, while every other type stays fresh.

A stream type is *pending* (`pending`) when its rows in `stream_state` were folded by another revision of its
reducer (bumped, added, removed; an upcaster registered or changed), or its history table does not follow
`stream_state` (turned on, another grain, a crash between the two commits). Until its swap the live table's
updates, the tailing run's and the automation's alike, leave that type alone: its rows stay as the old revision
folded them (in service, their lag growing), its new events wait in `events`, and every other type goes on.

The new version is built in a shadow (`Shadow`: `<warehouse>/_rebuilds/<table>-<hash>/`, a small lake of its own
holding a `stream_state` and the history table of that one type), in the rebuild's own turn
(`TURN`, lake/kernel/turn.py), never in `stream_state`'s:
1. *pieces*: every event of the type at one `events` version (the build's, recorded in the shadow's description)
   spread by slice into pieces of whole streams (lake/delta/pieces.py), each folded by this machine's cores
   (lake/state/whole_fold.py), the whole build at a lower priority (`NICE`), or, where the engine rule says, by Spark, and
   appended: its history rows first, then its state rows, whose commit records the piece and the history table's
   version it follows. A build killed half way resumes after its last piece; a history piece without its state
   piece is rolled back (restored) first;
2. *catch-up*: the type's events committed since, folded onto the shadow from `events`' change feed,
   `CATCH_UP_COMMITS` commits at a time, up to the version the live table has folded (never past it);
3. *swap*, in `stream_state`'s turn: the shadow caught up to the live table's `events` version exactly; then the
   type's history table written whole from the shadow's, the type's rows of `stream_state` replaced by the shadow's
   in one MERGE (rows of the type the shadow lacks deleted), the other history tables' empty commits, the typed
   state tables following; the shadow is removed last. A crash anywhere in the swap leaves the shadow, and the
   next run swaps again.

A second revision during the first (or another grain, other declared fields, `events` replaced) gives the type
another key: its shadow is dropped and the build starts again. `progress` reads how far each rebuild is (pieces
and events folded of the total, since when, the expected end) for health and the CLI; the setting
`ES_PIPELINE_REBUILDS=hold` keeps pending rebuilds from running (the old rows stay in service).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from deltalake import DeltaTable, write_deltalake

from es_pipeline.domain import Domain
from es_pipeline.lake.delta import current, pieces, tables
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel import feed, position
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.kernel.position import REVISION_SLOTS, next_txn_version
from es_pipeline.lake.kernel.turn import one_at_a_time
from es_pipeline.lake.state import forked, history, typed_state, whole_fold
from es_pipeline.lake.state.fold import (
    FOLD_OUT,
    READ_COLUMNS,
    STATE_SCHEMA,
    arrow_updates,
    read_columns,
    stale_types,
    with_schema_versions,
)
from es_pipeline.lake.state.state_table import (
    KEY,
    STREAM_STATE,
    app_id,
    fold_onto,
    follow_dead_letters,
    spark_columns,
    spark_fold,
    without_prior,
)
from es_pipeline.source import payloads

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

TURN = "stream_state.rebuild"  # the turn every rebuild beside `stream_state` takes (one at a time)
FOLDER = "_rebuilds"  # under the warehouse: one shadow per stream type being rebuilt
NICE = 10  # added to the niceness of the processes folding a rebuild's pieces: the live updates come first
CATCH_UP_COMMITS = 500  # `events` commits folded onto a shadow at a time while it catches up
REBUILDS = ("beside", "hold")  # ES_PIPELINE_REBUILDS: pending rebuilds run beside the live table, or wait
_PIECES = "es_pipeline.rebuild.pieces"  # txn app ids of a shadow's state table: pieces appended,
_FOLDED = "es_pipeline.rebuild.events"  # the `events` version folded (from its last piece on),
_HISTORY = "es_pipeline.rebuild.history"  # and the version of its history table this commit follows


def pending(warehouse: Location, domain: Domain, kinds: Iterable[Any], events_id: str, read: int,
            live: DeltaTable) -> list[str]:
    """The stream types to rebuild, from the (stream_type, revision) pairs `stream_state` (`live`) holds and its last
    commit (txn version `read`, from `events` of id `events_id`): a reducer changed (lake/state/fold.py
    `stale_types`), a history table unbound (lake/state/history.py `unbound`, which retypes in place a table whose
    fields alone changed: call it in `stream_state`'s turn), or a type a commit held back and no swap has replaced
    since (`held_back`: its events since are in no row, whatever the domain says now)."""
    kinds = list(kinds)
    stale = stale_types(kinds, domain)
    types = {t for t, _ in kinds} | set(domain.folds)
    return sorted({*stale, *history.unbound(warehouse, domain, events_id, read, stale),
                   *held_back(live, events_id, types)})


def held_app(events_id: str, stream_type: str) -> str:
    """The app id whose txn version marks a stream type held back by `stream_state`'s commits (the live table's txn
    version it was first held at, plus one)."""
    return f"es_pipeline.stream_state.held/{stream_type}@{events_id}"


def swapped_app(events_id: str, stream_type: str) -> str:
    """The app id whose txn version marks a stream type swapped in (the swap's txn version): held no longer."""
    return f"es_pipeline.stream_state.swapped/{stream_type}@{events_id}"


def held_back(live: DeltaTable, events_id: str, types: Iterable[str]) -> list[str]:
    """The stream `types` a commit of `live` held back and no swap has replaced since. Such a type stays pending
    whatever the domain says (a revision rolled back before its rebuild): the live table's position moved past its
    events, which only a rebuild folds."""
    out = []
    for stream_type in sorted({t for t in types if t is not None}):  # events of no type (NULL) have no reducer
        held = live.transaction_version(held_app(events_id, stream_type))
        swapped = live.transaction_version(swapped_app(events_id, stream_type))
        if held is not None and held > (swapped if swapped is not None else -1):
            out.append(stream_type)
    return out


def marks(live: DeltaTable, events_id: str, held: Collection[str], read: int) -> list[tuple[str, int]]:
    """The (app id, txn version) marks the next commit of `live` (from txn version `read`) adds for the types it
    holds back that are not marked yet."""
    marked = set(held_back(live, events_id, held))
    return [(held_app(events_id, t), read + 1) for t in sorted(held) if t not in marked]


def record(spark: Callable[[], SparkSession], path: str, pairs: list[tuple[str, int]]) -> None:
    """The (app id, txn version) `pairs` recorded in one commit of no rows (by Spark, one commit each, where delta-rs
    does not write the table: deletion vectors; `spark` makes its session, called only then)."""
    if not pairs:
        return
    table = DeltaTable(path)
    if not current.has_deletion_vectors(table):
        position.record(table, position.marks(pairs))
        return
    session = spark()
    empty = session.createDataFrame([], tables.read(session, path).schema)
    for app, version in pairs:
        empty.write.format("delta").mode("append").option("txnAppId", app).option("txnVersion", str(version)) \
            .save(path)


def without(rows: pa.Table, types: Collection[str]) -> pa.Table:
    """`rows` but those of the stream `types`."""
    column = rows["stream_type"]
    return rows.filter(pc.invert(pc.fill_null(pc.is_in(column, pa.array(sorted(types), column.type)), False)))


@dataclass(frozen=True)
class Shadow:
    """Where a stream type is rebuilt: a folder of the warehouse holding its `stream_state` and history table."""

    warehouse: Location
    stream_type: str

    @property
    def lake(self) -> str:
        tag = f"{zlib.crc32(self.stream_type.encode()):08x}"  # two types one table name would give stay apart
        return tables.table_path(self.warehouse, f"{FOLDER}/{typed_state.table_name(self.stream_type)}-{tag}")

    @property
    def state_path(self) -> str:
        return STREAM_STATE.path(self.lake)

    def plan(self) -> dict[str, Any] | None:
        """What the shadow was started as (its state table's description), None where there is none whole."""
        if not tables.is_delta_table(self.state_path):
            return None
        try:
            plan = json.loads(DeltaTable(self.state_path).metadata().description or "")
        except ValueError:
            return None
        return plan if isinstance(plan, dict) and "key" in plan else None

    def drop(self) -> None:
        """The shadow's folder and everything in it, if there."""
        tables.remove_folder(self.lake)


def shadows(warehouse: Location) -> list[Shadow]:
    """The shadows in the lake now, each with its stream type (from its description; unreadable ones: type "")."""
    fs, root = tables.filesystem(tables.table_path(warehouse, FOLDER))
    try:
        found = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except FileNotFoundError:
        return []
    out = []
    for info in sorted(found, key=lambda i: i.path):
        if info.type != pafs.FileType.Directory:
            continue
        name = info.path.rstrip("/").rsplit("/", 1)[-1]
        path = tables.table_path(tables.table_path(warehouse, FOLDER), name)
        stream_type = ""
        if tables.is_delta_table(STREAM_STATE.path(path)):
            try:
                stream_type = json.loads(DeltaTable(STREAM_STATE.path(path)).metadata().description or "{}")["type"]
            except (ValueError, KeyError):
                stream_type = ""
        shadow = Shadow(warehouse, stream_type)
        out.append(shadow if shadow.lake == path else _Orphan(warehouse, stream_type, path))
    return out


@dataclass(frozen=True)
class _Orphan(Shadow):
    """A shadow folder whose own description does not name it (a start cut short): only ever dropped."""

    path: str = ""

    @property
    def lake(self) -> str:
        return self.path


def drop_all(warehouse: Location, keep: Collection[str] = ()) -> list[str]:
    """Every shadow dropped but those of the stream types `keep`; the types dropped. In the rebuilds' turn."""
    dropped = []
    for shadow in shadows(warehouse):
        if shadow.stream_type in keep and not isinstance(shadow, _Orphan):
            continue
        shadow.drop()
        dropped.append(shadow.stream_type or "?")
    return dropped


def key_of(domain: Domain, stream_type: str, events_id: str) -> str:
    """What a shadow is built as: the `events` table, the type's revision, history grain and declared fields. A shadow
    of another key is dropped (a second revision during the first, `events` replaced)."""
    reducer = domain.folds.get(stream_type)
    fields = "" if reducer is None or reducer.state is None else ",".join(f"{f.name}:{f.type}" for f in reducer.state)
    grain = "" if reducer is None else reducer.history or ""
    return f"{events_id}/r{domain.revisions().get(stream_type, 0)}/{grain}/{fields}"


@dataclass(frozen=True)
class Progress:
    """How far a rebuild is: its stream type, phase ("pieces": folding what `events` held when it started; "catching
    up": the events since), events folded of the total at its start, pieces, when it started and when it should end
    at its pace so far (None until a piece is done)."""

    stream_type: str
    phase: str
    events_folded: int
    events_total: int
    pieces_done: int
    pieces: int
    events_version: int  # the `events` version it has folded up to (during the pieces, the one it started from)
    started: datetime
    expected_end: datetime | None

    def line(self) -> str:
        end = "" if self.expected_end is None else f", expected end {self.expected_end:%Y-%m-%d %H:%M:%S} UTC"
        share = self.events_folded / self.events_total if self.events_total else 1.0
        return (f"{self.stream_type}: {self.phase}, {self.events_folded:,} of {self.events_total:,} events folded "
                f"({share:.0%}; piece {self.pieces_done} of {self.pieces}), started "
                f"{self.started:%Y-%m-%d %H:%M:%S} UTC{end}")


def progress(warehouse: Location, now: datetime | None = None) -> list[Progress]:
    """Every rebuild under way, as its shadow records it."""
    now = now or datetime.now(UTC)
    out = []
    for shadow in shadows(warehouse):
        plan = shadow.plan()
        if plan is None or isinstance(shadow, _Orphan):
            continue
        table = DeltaTable(shadow.state_path)
        done = int(table.transaction_version(_PIECES) or 0)
        folded_to = table.transaction_version(_FOLDED)
        counts = [int(n) for n in plan["piece_events"]]
        total, folded = sum(counts), sum(counts[:done])
        started = datetime.fromtimestamp(plan["started"], UTC)
        end = None
        if 0 < folded < total:
            end = now + (now - started) * ((total - folded) / folded)
        out.append(Progress(shadow.stream_type, "pieces" if folded_to is None else "catching up", folded, total,
                            done, len(counts), int(plan["events_version"] if folded_to is None else folded_to),
                            started, end))
    return out


def run_pending(
    engine: Engine, warehouse: Location, domain: Domain, store_dsn: str | None, *,
    skip_unknown: bool = False, hold: bool = False, say: Callable[[str], None] = log.info,
) -> list[str]:
    """Every pending rebuild built beside and swapped in, one stream type after another, in the rebuilds' turn (the
    live table's turn only for each swap); the types swapped. Shadows no longer wanted are dropped. `hold`: none
    built (the old rows stay in service). `engine`: where a type's pieces are folded (Spark where its rule says)."""
    if not _built(warehouse):
        return []
    with one_at_a_time(store_dsn, TURN):
        with one_at_a_time(store_dsn, STREAM_STATE.name):  # `unbound` may retype a history table in place
            todo = pending_now(warehouse, domain)
        drop_all(warehouse, keep=todo)
        if hold or not todo:
            return []
        swapped = []
        for stream_type in todo:
            shadow = Shadow(warehouse, stream_type)
            if not build(engine, shadow, domain, skip_unknown=skip_unknown, say=say):
                continue
            with one_at_a_time(store_dsn, STREAM_STATE.name) as turn:
                if swap(engine, shadow, domain, turn, skip_unknown=skip_unknown, say=say):
                    swapped.append(stream_type)
                    follow_dead_letters(warehouse)  # the swapped type's quarantined rows, or none now
        return swapped


def pending_now(warehouse: Location, domain: Domain) -> list[str]:
    """`pending` read from the live table now ([] before its first build from this `events`); in its turn."""
    found = _live_kinds(warehouse)
    if found is None:
        return []
    live, events_id, read, kinds = found
    return pending(warehouse, domain, kinds, events_id, read, live)


def waiting(warehouse: Location, domain: Domain) -> list[str]:
    """The stream types to rebuild as `pending` finds them, read without a turn and without writing (a history table
    whose fields alone changed, which an update retypes in place, is not counted): what the rebuilds' sensor asks."""
    found = _live_kinds(warehouse)
    if found is None:
        return []
    live, events_id, read, kinds = found
    unbound = [t for t, (reducer, table) in history.history_tables(domain).items()
               if not tables.is_delta_table(table.path(warehouse))
               or DeltaTable(table.path(warehouse)).transaction_version(history.app_id(table, events_id, reducer)) != read]
    return sorted({*stale_types(kinds, domain), *unbound,
                   *held_back(live, events_id, {t for t, _ in kinds} | set(domain.folds))})


def _live_kinds(warehouse: Location) -> tuple[DeltaTable, str, int, list[tuple[str, int]]] | None:
    """The live table, the id of the `events` it folds, its last txn version, and the (stream_type, revision) pairs
    its rows hold; None before its first build from this `events`."""
    if not _built(warehouse):
        return None
    live = DeltaTable(STREAM_STATE.path(warehouse))
    events_id = tables.table_id(EVENTS.path(warehouse))
    read = live.transaction_version(app_id(events_id))
    if read is None:
        return None
    kinds = current.files(STREAM_STATE.path(warehouse), live).to_table(columns=["stream_type", "revision"]) \
        .group_by(["stream_type", "revision"]).aggregate([])
    return live, events_id, int(read), list(zip(kinds["stream_type"].to_pylist(), kinds["revision"].to_pylist(),
                                                strict=True))


def _built(warehouse: Location) -> bool:
    return tables.is_delta_table(STREAM_STATE.path(warehouse)) and tables.is_delta_table(EVENTS.path(warehouse))


def _live_folded(warehouse: Location, events_id: str) -> int | None:
    """The `events` version the live `stream_state` has folded (it only grows), None where not from this `events`."""
    read = DeltaTable(STREAM_STATE.path(warehouse)).transaction_version(app_id(events_id))
    return None if read is None else int(read) // REVISION_SLOTS


def build(engine: Engine, shadow: Shadow, domain: Domain, *, skip_unknown: bool = False,
          say: Callable[[str], None] = log.info, stop_after: int | None = None) -> bool:
    """The shadow whole and caught up to what the live table has folded (started, or resumed where it was); False
    where it cannot be (the live table not from this `events`). In the rebuilds' turn, at a lower priority
    (`NICE`; its forked folds in a scheduling group of their own, lake/state/forked.py `in_background`).
    `stop_after`: return after that many pieces (a test's crash half way)."""
    # Every core (bench/results/rebuild_beside.md: a core left free spared the tailing run nothing on 2 cores, and
    # made the rebuild 1.5x longer); the forked folds in a scheduling group of their own at the lowest priority.
    with _yielding(NICE), forked.background():
        return _build(engine, shadow, domain, skip_unknown, say, stop_after)


@contextmanager
def _yielding(nice: int) -> Iterator[None]:
    """This thread (and the processes it forks) `nice` lower in priority for the block, then as before where the
    system lets it (lowering a niceness again needs CAP_SYS_NICE: else it stays, until the run ends). The
    process's other threads are left as they are: a library caller's work is its own."""
    thread = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, thread)
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, before + nice))
    except OSError:
        pass
    try:
        yield
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, thread, before)
        except OSError:
            log.info("a rebuild's niceness (%s) kept: lowering it again needs CAP_SYS_NICE", before + nice)


def _build(engine: Engine, shadow: Shadow, domain: Domain, skip_unknown: bool, say: Callable[[str], None],
           stop_after: int | None) -> bool:
    events_path = EVENTS.path(shadow.warehouse)
    events_id = tables.table_id(events_path)
    key = key_of(domain, shadow.stream_type, events_id)
    plan = shadow.plan()
    if plan is not None and plan["key"] != key:
        say(f"rebuild of {shadow.stream_type}: its shadow was built as another version ({plan['key']}): started again")
        shadow.drop()
        plan = None
    if _live_folded(shadow.warehouse, events_id) is None:
        return False
    if plan is None or DeltaTable(shadow.state_path).transaction_version(_FOLDED) is None:
        try:
            built = _pieces(engine, shadow, domain, key, plan, skip_unknown, say, stop_after)
        except Exception as exc:  # noqa: BLE001 - only files gone under a resumed plan start again; the rest raises
            if plan is None or not _files_gone(exc):
                raise
            # Vacuum removes files, not log entries: the version still loads, its pieces no longer read.
            say(f"rebuild of {shadow.stream_type}: the files of events version {plan['events_version']}, which it "
                "was built from, were vacuumed: started again at the version stream_state has folded")
            shadow.drop()
            try:
                built = _pieces(engine, shadow, domain, key, None, skip_unknown, say, stop_after)
            except Exception as again:  # noqa: BLE001 - as above
                if not _files_gone(again):
                    raise
                shadow.drop()  # the live table's version vacuumed too: its own update builds it anew first
                say(f"rebuild of {shadow.stream_type}: the files of the events version stream_state has folded were "
                    "vacuumed too: it waits for stream_state's next update")
                return False
        if not built:
            return False
    upto = _live_folded(shadow.warehouse, events_id)
    assert upto is not None
    return _catch_up(shadow, domain, upto, skip_unknown)


def _files_gone(exc: BaseException) -> bool:
    """Whether a failed read means files of the version read were removed (a vacuum), on disk or object storage."""
    return isinstance(exc, FileNotFoundError) or tables.change_feed_gone(exc)


def _histories(domain: Domain, stream_type: str) -> whole_fold.Histories:
    return {t: h for t, h in history.history_tables(domain).items() if t == stream_type}


def _pieces(engine: Engine, shadow: Shadow, domain: Domain, key: str, plan: dict[str, Any] | None,
            skip_unknown: bool, say: Callable[[str], None], stop_after: int | None) -> bool:
    """Step 1: the pieces not yet appended, folded and appended (the shadow started where there is none)."""
    events_path = EVENTS.path(shadow.warehouse)
    # Built from the `events` version the live table has folded (never a later one: the swap, at the live table's
    # version, would hold events its next increments fold again).
    live = _live_folded(shadow.warehouse, tables.table_id(events_path))
    version = live if plan is None else int(plan["events_version"])
    try:
        events = DeltaTable(events_path, version=version)
    except Exception:  # noqa: BLE001 - the version it started from is gone (vacuumed, `events` replaced): anew
        shadow.drop()
        plan, events = None, DeltaTable(events_path, version=live)
    size = tables.files_bytes(events)
    count = pieces.count_for(size) if plan is None else len(plan["piece_events"])
    spark_builds = engine.on_spark(lambda: size)
    stream_type = shadow.stream_type
    read = [*READ_COLUMNS, "slice", *(["metadata"] if domain.metadata_field else [])]
    if spark_builds:
        session = engine.session()
        rows = _spark_events(session, events_path, int(events.version()), stream_type, domain)
        counts = _spark_piece_counts(rows, count) if plan is None else plan["piece_events"]
        if plan is None:
            plan = _start(shadow, domain, key, int(events.version()), counts)
        return _append_pieces(shadow, domain, plan, skip_unknown, say, stop_after,
                              lambda i: _spark_piece(rows, i, count, domain, skip_unknown, stream_type))
    counted = [0] * count
    of_piece = pieces.by_slice(count)

    def of_type() -> Iterator[pa.RecordBatch]:
        for batch in pieces.batches(events_path, events, read):
            batch = batch.filter(pc.equal(batch["stream_type"], stream_type))
            if batch.num_rows:
                for run in pc.value_counts(of_piece(batch)).to_pylist():
                    counted[run["values"]] += run["counts"]
                yield batch

    with pieces.spread(of_type(), pieces.schema(events, read), count, of_piece) as parts:
        if plan is None:
            plan = _start(shadow, domain, key, int(events.version()), counted)
        histories = _histories(domain, stream_type)
        return _append_pieces(shadow, domain, plan, skip_unknown, say, stop_after,
                              lambda i: whole_fold.fold_piece(parts.read(i), domain, skip_unknown, histories))


def _start(shadow: Shadow, domain: Domain, key: str, events_version: int, counts: list[int]) -> dict[str, Any]:
    """The shadow's tables made empty, its plan in the state table's description."""
    shadow.drop()
    plan = {"key": key, "type": shadow.stream_type, "events_version": events_version,
            "piece_events": [int(n) for n in counts], "started": time.time()}
    recorded = []
    table = _history_table(domain, shadow.stream_type)
    if table is not None:
        write_deltalake(table.path(shadow.lake), table.schema.empty_table(), mode="overwrite",
                        partition_by=history.PARTITION)
        recorded = [(_HISTORY, 0)]
    write_deltalake(shadow.state_path, STATE_SCHEMA.empty_table(), mode="overwrite", description=json.dumps(plan),
                    commit_properties=position.marks([(_PIECES, 0), *recorded]))
    return plan


def _history_table(domain: Domain, stream_type: str) -> Any:
    found = history.history_tables(domain).get(stream_type)
    return None if found is None else found[1]


def _history_settled(shadow: Shadow, domain: Domain) -> int | None:
    """The shadow's history table's version, rolled back to the one its state table's last commit follows where a
    later commit (its part of a step cut short) went beyond it; None where the type keeps no history."""
    table = _history_table(domain, shadow.stream_type)
    if table is None:
        return None
    held = DeltaTable(table.path(shadow.lake))
    recorded = int(DeltaTable(shadow.state_path).transaction_version(_HISTORY) or 0)
    if int(held.version()) != recorded:
        held.restore(recorded)
        held = DeltaTable(table.path(shadow.lake))
    return int(held.version())


def _append_pieces(shadow: Shadow, domain: Domain, plan: dict[str, Any], skip_unknown: bool,
                   say: Callable[[str], None], stop_after: int | None,
                   fold_piece: Callable[[int], tuple[pa.Table, whole_fold.Built]]) -> bool:
    counts = [int(n) for n in plan["piece_events"]]
    state = DeltaTable(shadow.state_path)
    done = int(state.transaction_version(_PIECES) or 0)
    table = _history_table(domain, shadow.stream_type)
    started = time.monotonic()
    for i in range(done, len(counts)):
        if stop_after is not None and i - done >= stop_after:
            return False
        _history_settled(shadow, domain)
        out, built = fold_piece(i)
        recorded = []
        if table is not None:
            parts = built.get(shadow.stream_type) or []
            rows = pa.concat_tables(parts) if parts else table.schema.empty_table()
            write_deltalake(table.path(shadow.lake), rows, mode="append", partition_by=history.PARTITION)
            recorded = [(_HISTORY, int(DeltaTable(table.path(shadow.lake)).version()))]
        last = [(_FOLDED, int(plan["events_version"]))] if i == len(counts) - 1 else []
        write_deltalake(shadow.state_path, arrow_updates(out).cast(STATE_SCHEMA), mode="append",
                        commit_properties=position.marks([(_PIECES, i + 1), *recorded, *last]))
        say(f"rebuild of {shadow.stream_type}: piece {i + 1} of {len(counts)} folded ({sum(counts[:i + 1]):,} of "
            f"{sum(counts):,} events, {time.monotonic() - started:.1f} s)")
    if not counts:  # nothing of the type in `events`: the shadow is whole, and empty
        write_deltalake(shadow.state_path, STATE_SCHEMA.empty_table(), mode="append",
                        commit_properties=position.commit_properties(_FOLDED, int(plan["events_version"])))
    return True


def _spark_events(spark: SparkSession, events_path: str, version: int, stream_type: str, domain: Domain) -> Any:
    from pyspark.sql import functions as F

    return tables.read(spark, events_path, version=version).where(F.col("stream_type") == stream_type) \
        .select(*spark_columns(domain), "slice")


def _piece_column(count: int) -> Any:
    from pyspark.sql import functions as F

    return F.floor(F.col("slice").cast("long") * count / pieces.SLICES).cast("int")


def _spark_piece_counts(rows: Any, count: int) -> list[int]:
    counts = [0] * count
    for row in rows.groupBy(_piece_column(count).alias("piece")).count().collect():
        counts[int(row["piece"])] = int(row["count"])
    return counts


def _spark_piece(rows: Any, i: int, count: int, domain: Domain, skip_unknown: bool,
                 stream_type: str) -> tuple[pa.Table, whole_fold.Built]:
    """Piece `i` folded by Spark, its output brought here (a piece's streams: bounded) with its history rows."""
    events = rows.where(_piece_column(count) == i).drop("slice")
    out = spark_fold(without_prior(events), domain, skip_unknown).toArrow()
    out = pa.Table.from_batches(out.cast(FOLD_OUT).to_batches(), schema=FOLD_OUT)
    found = history.history_tables(domain).get(stream_type)
    return out, ({} if found is None else {stream_type: [history.rows_of(out, *found)]})


def _catch_up(shadow: Shadow, domain: Domain, upto: int, skip_unknown: bool) -> bool:
    """Step 2: the type's events of the `events` commits after the shadow's version up to `upto` folded onto it;
    False where the change feed no longer holds them (the shadow dropped: built again next time)."""
    events_path = EVENTS.path(shadow.warehouse)
    events = DeltaTable(events_path)
    events_id = str(events.metadata().id)
    columns = read_columns(domain)
    state = DeltaTable(shadow.state_path)
    at = int(state.transaction_version(_FOLDED) or 0)
    if at > upto:  # (never: built from the live table's version) a shadow ahead of the live table is never swapped
        log.warning("rebuild of %s: its shadow is ahead of stream_state (%s > %s): started again", shadow.stream_type,
                    at, upto)
        shadow.drop()
        return False
    while at < upto:
        end = min(upto, at + CATCH_UP_COMMITS)
        rows = feed.new_rows(events, at, end, columns, whole=True, predicate=f"stream_type = {_literal(shadow.stream_type)}")
        if rows is None:
            log.warning("rebuild of %s: the change feed after events version %s is gone: started again",
                        shadow.stream_type, at)
            shadow.drop()
            return False
        rows = rows.filter(pc.equal(rows["stream_type"], shadow.stream_type))
        recorded = []
        _history_settled(shadow, domain)
        if rows.num_rows:
            new = with_schema_versions(payloads.for_reducers(tables.tenant_filled(rows)), domain)
            out, _ = fold_onto(current.files(shadow.state_path, state).to_table(), new, domain, skip_unknown)
            table = _history_table(domain, shadow.stream_type)
            if table is not None:
                others = [t for t in history.history_tables(domain) if t != shadow.stream_type]
                history.write_arrow(shadow.lake, domain, out, events_id, end, whole=(), skip=others)
                recorded = [(_HISTORY, int(DeltaTable(table.path(shadow.lake)).version()))]
            state.merge(arrow_updates(out).cast(STATE_SCHEMA), predicate=" AND ".join(f"t.{k} = u.{k}" for k in KEY),
                        source_alias="u", target_alias="t",
                        commit_properties=position.marks([(_FOLDED, end), *recorded])) \
                .when_matched_update_all().when_not_matched_insert_all().execute()
        else:
            position.record(state, position.commit_properties(_FOLDED, end))
        state = DeltaTable(shadow.state_path)
        at = end
    return True


def swap(engine: Engine, shadow: Shadow, domain: Domain, turn: Any, *, skip_unknown: bool = False,
         say: Callable[[str], None] = log.info) -> bool:
    """Step 3, in `stream_state`'s turn: the shadow caught up to the live table exactly and swapped in; False where it
    could not be (the live table moved to another `events`, the change feed gone: built again next time)."""
    warehouse, stream_type = shadow.warehouse, shadow.stream_type
    state_path, events_path = STREAM_STATE.path(warehouse), EVENTS.path(warehouse)
    events_id = tables.table_id(events_path)
    app = app_id(events_id)
    live = DeltaTable(state_path)
    found = live.transaction_version(app)
    plan = shadow.plan()
    if found is None or plan is None or plan["key"] != key_of(domain, stream_type, events_id):
        return False
    read = int(found)
    if not _catch_up(shadow, domain, read // REVISION_SLOTS, skip_unknown):
        return False
    started = time.monotonic()
    held = set(pending_now(warehouse, domain))  # the others still to rebuild keep their tables as they are
    rows = current.files(shadow.state_path, DeltaTable(shadow.state_path)).to_table()
    rows = rows.set_column(rows.schema.get_field_index("updated_at"), "updated_at",
                           pa.array([datetime.now(UTC)] * rows.num_rows, STATE_SCHEMA.field("updated_at").type))
    mine = current.files(state_path, live).to_table(columns=list(KEY) + ["stream_type"])
    gone = mine.filter(pc.equal(mine["stream_type"], stream_type)).select(list(KEY)) \
        .join(rows.select(list(KEY)), list(KEY), join_type="left anti")  # rows the shadow lacks: deleted
    version = next_txn_version(read // REVISION_SLOTS, domain.folds, read)
    if version <= read:  # every slot of this `events` version taken (decision 0043): after its next commit
        say(f"rebuild of {stream_type}: no transaction version left at events version {read // REVISION_SLOTS}: "
            "swapped after the next `events` commit")
        return False
    turn.confirm(state_path, app, read)
    found_history = history.history_tables(domain).get(stream_type)
    if found_history is not None:  # the type's history table first: a crash after it leaves the type to swap again
        reducer, table = found_history
        shadow_history = DeltaTable(table.path(shadow.lake))
        write_deltalake(table.path(warehouse), pa.RecordBatchReader.from_batches(
            table.schema, _history_rows(table.path(shadow.lake), shadow_history, table.schema)), mode="overwrite",
            schema_mode="overwrite",
            partition_by=history.PARTITION, description=f"es_pipeline: {table.comment}",
            commit_properties=position.commit_properties(history.app_id(table, events_id, reducer), version))
    literal = _literal(stream_type)
    if current.has_deletion_vectors(live):  # delta-rs does not write such a table: Spark swaps it
        _swap_spark(engine.session(), state_path, rows, literal, app, version)
        # After the swap (a crash between leaves the type held, swapped again next time).
        record(engine.session, state_path, [(swapped_app(events_id, stream_type), version)])
    else:
        live.merge(rows.cast(STATE_SCHEMA), predicate=" AND ".join(f"t.{k} = u.{k}" for k in KEY), source_alias="u",
                   target_alias="t", commit_properties=position.marks([
                       (app, version), (swapped_app(events_id, stream_type), version)])) \
            .when_matched_update_all().when_not_matched_insert_all() \
            .when_not_matched_by_source_delete(predicate=f"t.stream_type = {literal}").execute()
    empty = FOLD_OUT.empty_table()
    history.write_arrow(warehouse, domain, empty, events_id, version, whole=(), skip={stream_type, *held})
    typed_state.update(warehouse, domain)
    typed = typed_state.typed_tables(domain).get(stream_type)
    if gone.num_rows and typed is not None and tables.is_delta_table(typed[1].path(warehouse)):
        # The typed table follows inserts and updates of the change feed: the streams deleted, deleted here.
        DeltaTable(typed[1].path(warehouse)).merge(
            gone, predicate=" AND ".join(f"t.{k} = u.{k}" for k in KEY), source_alias="u", target_alias="t") \
            .when_matched_delete().execute()
    shadow.drop()
    say(f"rebuild of {stream_type}: swapped into stream_state in one commit ({rows.num_rows:,} streams, "
        f"{time.monotonic() - started:.1f} s)")
    return True


def _literal(text: str) -> str:
    """`text` as an SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def _history_rows(path: str, table: DeltaTable, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """A history table's rows, a batch at a time, as `schema` (`is_current` from `valid_to`: a partition column is not
    in the files)."""
    for batch in pieces.batches(path, table, [n for n in schema.names if n != "is_current"]):
        columns = {n: batch.column(n) for n in batch.schema.names}
        columns["is_current"] = pc.is_null(columns["valid_to"])
        yield pa.RecordBatch.from_arrays([columns[n].cast(schema.field(n).type) for n in schema.names], schema=schema)


def _swap_spark(spark: SparkSession, state_path: str, rows: pa.Table, literal: str, app: str, version: int) -> None:
    source = spark.createDataFrame(rows.cast(STATE_SCHEMA))
    on = " AND ".join(f"t.{k} = u.{k}" for k in KEY)
    with tables.spark_merge_source(spark, source, state_path, app, version) as view:
        spark.sql(f"MERGE INTO delta.`{state_path}` t USING {view} u ON {on} WHEN MATCHED THEN UPDATE SET * "
                  f"WHEN NOT MATCHED THEN INSERT * WHEN NOT MATCHED BY SOURCE AND t.stream_type = {literal} "
                  "THEN DELETE")

