"""The per-stream fold: each stream's events, in version order, through its type's reducer (no Delta here).

What `stream_state` keeps (lake/state/stream_state.py) is made here, the same way on every engine: Spark's
Python workers (`fold_partitions`, a `mapInArrow` function), a small increment in this process, and the
first build's forked processes (lake/state/whole_fold.py) all fold with `StreamFold`:

- a stream's versions can reach the lake out of order (two transactions whose xids are in the other order
  than their commits), so only the contiguous run after the folded version is applied; later events wait
  in the row's `parked` column, and are folded when the gap fills;
- a stream type with no reducer keeps its versions and times alone (no state, revision 0);
- a reducer's failure stops its stream there, named (`error`), and the update commits nothing; under quarantine
  (`Domain.fold_errors`, docs/decisions/0051) the stream is held at its last good state instead, its failing and
  later events parked, `quarantined` saying where and why, and the update goes on with every other stream;
- a reducer that keeps history (`Domain.reducer(..., history=...)`) also leaves a trail: the rows its stream's
  history table gains (lake/state/history.py), each state with its version range and `valid_from`, the
  running maximum of `recorded_at`; `history_from` / `history_at` carry the current history row's first
  version and `valid_from` from one update to the next.

The fold's output (`FOLD_OUT`) is `stream_state`'s row without `updated_at`, plus the fold's own
`folded` (events folded), `error` and `history` (the trail, JSON) columns.

`quarantined` (JSON, null for a healthy stream): the failing event's `version` and `event_type`, the error's `kind`
(its exception's class) and `message` (the team's: it stays in the lake), `since` (first quarantined there, ISO
time, UTC) and `retries` (the updates that refolded it since, and failed again).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import repeat
from typing import Any, NamedTuple
from zoneinfo import ZoneInfo

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from es_pipeline.domain import UTC_MICROS, Domain, Event, Reducer, UnknownEventType
from es_pipeline.errors import ReducerError
from es_pipeline.lake.kernel.result import Ran, Result
from es_pipeline.lake.state import state_json

FOLD_OUT = pa.schema([
    ("stream_id", pa.string()), ("stream_type", pa.string()), ("version", pa.int32()), ("state", pa.string()),
    ("last_event_at", UTC_MICROS), ("revision", pa.int32()), ("parked", pa.string()),
    ("skipped", pa.int32()), ("folded", pa.int32()), ("error", pa.string()), ("tenant", pa.string()),
    ("history_from", pa.int32()), ("history_at", UTC_MICROS), ("history", pa.string()), ("quarantined", pa.string()),
])
# Added to tables of earlier releases, in this order.
_AFTER_TENANT = ("tenant", "history_from", "history_at", "quarantined")
# `stream_state`'s columns: the fold's output without its own columns, stamped when committed.
STATE_SCHEMA = pa.schema([*(f for f in FOLD_OUT if f.name not in ("folded", "error", "history", *_AFTER_TENANT)),
                          pa.field("updated_at", UTC_MICROS), *(FOLD_OUT.field(n) for n in _AFTER_TENANT)])
HISTORY_COLUMNS = ("history_from", "history_at")  # stream_state's, for the history tables (lake/state/history.py)
LATER_COLUMNS = (*HISTORY_COLUMNS, "quarantined")  # stream_state's columns since tenants, added in place where missing
FOLD_COLUMNS = ["stream_id", "stream_type", "version", "event_type", "payload", "recorded_at", "tenant"]  # of events
READ_COLUMNS = [*FOLD_COLUMNS, "payload_encoding"]  # read; the fold gets payloads as reducers read them


class Rules(NamedTuple):
    """How a fold treats what it cannot fold: an unknown event type skipped and counted (else a failure), and a
    failure quarantining its stream (else stopping the update): `StreamFold`'s last two arguments."""

    skip_unknown: bool = False
    quarantine: bool = False


@dataclass(frozen=True)
class Written:
    """One `stream_state` commit as its writer saw it: the versions before and after it, the rows it wrote (their
    post-images) and which of them are new streams. The typed tables follow it from these (lake/state/typed_state.py)
    instead of reading the commit back from the change feed."""

    before: int
    after: int
    rows: pa.Table
    inserted: pa.Array  # per row of `rows`: a stream `stream_state` had no row of before


def state_result(events_version: int, previous: int, folded: int, streams: int, parked: int, skipped: int,
                 without_reducer: int = 0, *, engine: Ran = "local", history_rows: Mapping[str, int] | None = None,
                 held_types: Iterable[str] = (), quarantined: int = 0) -> Result:
    """What an update of `stream_state` did, as the kernel's `Result`: its figures as its asset shows them (streams
    updated, parked, quarantined (of those folded: every quarantined stream is, at each update), events skipped,
    streams whose type has no reducer, the stream types held for their rebuild beside, rows per history table;
    `typed_rows/<table>` and `rebuilt_types` are added where they follow)."""
    return Result("stream_state", events_version, previous, folded, engine, None, {
        "streams_updated": streams, "parked_streams": parked, "quarantined_streams": quarantined,
        "skipped_unknown_events": skipped,
        "streams_without_reducer": without_reducer, "rebuilt_types": "-",
        "rebuilding_types": ", ".join(held_types) or "-",
        **{f"history_rows/{name}": n for name, n in sorted((history_rows or {}).items())}})


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_DAY_MICROS = 86_400_000_000
_new_event = tuple.__new__  # Event(...) without its Python-level __new__: one per event folded


def _timestamp(micros: int | None) -> datetime | None:
    return None if micros is None else _EPOCH + timedelta(microseconds=micros)


def day_of(grain: str) -> Any:
    """For a "daily:<zone>" history: the function of a time (microseconds since the epoch) giving its day there."""
    zone = grain.partition(":")[2]
    if zone == "UTC":
        return lambda micros: micros // _DAY_MICROS
    where = ZoneInfo(zone)
    return lambda micros: (_EPOCH + timedelta(microseconds=micros)).astimezone(where).toordinal()


class PayloadNotJson(ValueError):
    """An event's payload that is not JSON (a writer's bug): the fold fails on it like a reducer that raises."""


def read_payload(text: str | None) -> Any:
    """An event's payload as reducers get it: orjson's reading (an integer past 64 bits is a double to it), or
    json's for what orjson refuses (NaN, Infinity); `PayloadNotJson` for a text neither reads, or none."""
    if text is None:  # a source column that may be NULL: no JSON, as a text that is none
        raise PayloadNotJson("the payload is not JSON (it is null)")
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(text)  # what orjson refuses: NaN, Infinity
    except ValueError as exc:
        raise PayloadNotJson(f"the payload is not JSON ({exc})") from None


class StreamFold:
    """One stream's fold within a partition: its prior row (if any), then its events in version order.
    Times travel as microseconds since the epoch (a datetime per event would cost as much as the fold)."""

    __slots__ = ("tenant", "stream_id", "stream_type", "reducer", "fold", "skip_unknown", "state", "version",
                 "last_at", "skipped", "folded", "parked", "error", "codec", "last_type", "day", "trail",
                 "history_from", "history_at", "seen", "prior_row", "quarantined", "kind", "held")

    def __init__(
        self, tenant: str, stream_id: str, stream_type: str, reducer: Reducer | None, skip_unknown: bool,
        quarantine: bool = False,
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
        self.codec = state_json.codec(reducer.state if reducer is not None else None)
        self.last_type: str | None = None  # of the last event folded: a state that does not fit names it
        grain = reducer.history if reducer is not None else None
        # With history: the day function ("each": None), the rows gained ([version_from, version_to, valid_from,
        # state JSON]), and the current history row's first version and valid_from (the running max so far).
        self.day = None if grain is None or grain == "each" else day_of(grain)
        self.trail: list[list[Any]] | None = None if grain is None else []
        self.history_from: int | None = None
        self.history_at: int | None = None
        # Quarantine (docs/decisions/0051): every event given this update, so that a failure can be refolded back to
        # the last good state; None: a failure stops the stream with `error` (the update then fails).
        self.seen: list[tuple[int, str, str, int | None]] | None = [] if quarantine else None
        self.prior_row: tuple[Any, ...] = (None, 0, None, None, None, None)
        self.quarantined: dict[str, Any] | None = None  # where quarantined: the failing event and why
        self.kind: str | None = None  # the error's kind (its exception's class), with `error`
        self.held: dict[str, Any] | None = None  # the prior row's `quarantined`: since when, how many retries

    def prior(self, state: str | None, version: int, last_at: int | None, skipped: int | None,
              history_from: int | None = None, history_at: int | None = None, quarantined: str | None = None) -> None:
        self.prior_row = (state, version, last_at, skipped, history_from, history_at)
        self.held = json.loads(quarantined) if quarantined else None
        self.state = self.codec.loads(state) if state is not None and self.fold is not None else {}
        self.version, self.last_at, self.skipped = version, last_at, skipped or 0
        self.history_from, self.history_at = history_from, history_at

    def event(self, v: int, event_type: str, payload: str, recorded_at: int | None) -> None:
        """Fold one event, or park it (a gap before it), or pass it by (folded already, or after an error).
        Run for every event of a rebuild: the next version of a stream with nothing parked goes straight on."""
        if self.seen is not None:
            self.seen.append((v, event_type, payload, recorded_at))
        if v != self.version + 1 or self.parked or self.error is not None:
            self._off_the_run(v, event_type, payload, recorded_at)
            return
        if self.fold is None:  # no reducer: the stream's versions and times alone
            self.version, self.last_at = v, recorded_at
            self.folded += 1
            return
        try:
            data = read_payload(payload)
        except PayloadNotJson as exc:
            self._failed(exc, v, event_type)
            return
        if self.day is not None and not self._before(recorded_at, self.state):
            return
        try:
            self.state = self.fold(self.state, _new_event(Event, (self.stream_id, v, event_type, data)))
        except Exception as exc:  # noqa: BLE001 - any reducer failure is reported, with its place
            if not self._failed(exc, v, event_type):
                return
        if self.trail is not None and not self._keep(v, event_type, recorded_at, self.state):
            return
        self.version, self.last_at, self.last_type = v, recorded_at, event_type
        self.folded += 1

    def events(self, run: Iterator[tuple[int, str, str, int | None]]) -> None:
        """Every event of `run` (this stream's, in version order) as `event` folds them, the stream's figures
        kept in locals while each event is the next version (a first build's every event but a gap's)."""
        if not self.parked and self.error is None:
            state, version, last_at, folded, kind = self.state, self.version, self.last_at, self.folded, self.last_type
            fold, stream_id, keep = self.fold, self.stream_id, self._keep if self.trail is not None else None
            before = self._before if self.day is not None else None
            seen = self.seen
            off: tuple[int, str, str, int | None] | None = None
            for v, event_type, payload, recorded_at in run:
                if v != version + 1:
                    off = (v, event_type, payload, recorded_at)
                    break
                if seen is not None:
                    seen.append((v, event_type, payload, recorded_at))
                if fold is not None:  # else no reducer: the versions and times alone
                    try:
                        data = read_payload(payload)
                    except PayloadNotJson as exc:
                        self._failed(exc, v, event_type)
                        break
                    if before is not None and not before(recorded_at, state):
                        break
                    try:
                        state = fold(state, _new_event(Event, (stream_id, v, event_type, data)))
                    except Exception as exc:  # noqa: BLE001 - as in `event`
                        if not self._failed(exc, v, event_type):
                            break
                    if keep is not None and not keep(v, event_type, recorded_at, state):
                        break
                version, last_at, folded, kind = v, recorded_at, folded + 1, event_type
            self.state, self.version, self.last_at, self.folded, self.last_type = state, version, last_at, folded, kind
            if off is not None:
                self.event(*off)
        for rest in run:  # after a gap or an error: one by one
            self.event(*rest)

    def _keep(self, v: int, event_type: str, recorded_at: int | None, state: dict[str, Any]) -> bool:
        """The state after event `v` onto the trail: a row of its own, or (daily) the row of its day, replacing the
        current history row where that is of the same day. False: the state does not fit its declared fields (the
        stream's error, named). A daily row's text waits until its day is over (`_before`) or the fold ends
        (`_settle`): only a day's last state is written."""
        text: str | None = None
        if self.day is None:
            try:
                text = self.codec.trail_text(state)
            except state_json.StateMisfit as misfit:
                self.error, self.kind = json.dumps([self.stream_id, v, event_type, str(misfit)]), "StateMisfit"
                return False
        held = self.history_at
        at = (held or 0) if recorded_at is None else recorded_at if held is None or recorded_at > held else held
        trail = self.trail
        assert trail is not None
        day = self.day
        if day is not None and trail and day(trail[-1][2]) == day(at):
            trail[-1][1], trail[-1][3] = v, text  # the same day: the day's row ends here now (from its first change)
        elif day is not None and not trail and self.history_from is not None and self.history_at is not None \
                and day(self.history_at) == day(at):
            # Goes on with the current row's day: replaces it, keeping its valid_from (the MERGE leaves it).
            trail.append([self.history_from, v, at, text])
        else:
            trail.append([v, v, at, text])
        self.history_at = at
        return True

    def _before(self, recorded_at: int | None, state: dict[str, Any]) -> bool:
        """Daily, before an event is folded: if it starts another day, the day's row takes its text from `state`
        (its last state, not yet changed by the next event's fold, which may change it in place)."""
        trail = self.trail
        if not trail or trail[-1][3] is not None:
            return True
        held = self.history_at
        at = held if recorded_at is None or (held is not None and held >= recorded_at) else recorded_at
        if at is None or self.day(trail[-1][2]) == self.day(at):  # type: ignore[misc]
            return True
        return self._settle(state)

    def _settle(self, state: dict[str, Any]) -> bool:
        """The last row's text from `state`, where it waits for it (daily); False: it does not fit (the error)."""
        trail = self.trail
        if not trail or trail[-1][3] is not None:
            return True
        try:
            trail[-1][3] = self.codec.trail_text(state)
        except state_json.StateMisfit as misfit:
            self.error = json.dumps([self.stream_id, trail[-1][1], self.last_type or "?", str(misfit)])
            self.kind = "StateMisfit"
            return False
        return True

    def _history(self) -> str | None:
        """The trail as the history table's writer takes it (lake/state/history.py): the rows, each ending where the
        next begins (the last: current), and the current row they close (its first version), if any."""
        trail = self.trail
        if not trail:
            return None
        rows = [{"f": f, "t": t, "a": a, "b": b, "s": s} for f, t, a, b, s in self.history_rows()]
        closes = self.history_from if self.history_from is not None and trail[0][0] != self.history_from else None
        return orjson.dumps({"c": closes, "r": rows}).decode()

    def history_rows(self) -> Iterator[tuple[int, int, int, int | None, str]]:
        """The trail's rows: (version_from, version_to, valid_from, valid_to, state JSON), times in microseconds,
        each ending where the next begins (the last: current, None)."""
        trail = self.trail or []
        last = len(trail) - 1
        for i, (f, t, a, s) in enumerate(trail):
            yield f, t, a, trail[i + 1][2] if i < last else None, s

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
        self.error, self.kind = json.dumps([self.stream_id, v, event_type, reason]), type(exc).__name__
        return False

    def _off_the_run(self, v: int, event_type: str, payload: str, recorded_at: int | None) -> None:
        if self.error is not None or v <= self.version or (self.parked and self.parked[-1]["version"] >= v):
            return  # after an error, or already folded, or a duplicate of a parked event
        self.parked.append({"version": v, "event_type": event_type, "payload": payload,
                            "recorded_at": _timestamp(recorded_at)})

    def row(self, with_trail: bool = True) -> tuple[Any, ...]:
        """The stream's row; a state that does not fit its declared fields (or JSON) is the stream's error, named
        by the last event folded. `with_trail`: with the history's trail as JSON (else the caller takes
        `history_rows`). Under quarantine, a stream that failed is refolded to its last good state first, the
        failing event and those after it parked, `quarantined` saying why (`_quarantine`)."""
        row = self._row(with_trail)
        if self.error is None or self.seen is None:
            return row
        return self._row(with_trail) if self._quarantine() else row

    def _quarantine(self) -> bool:
        """The stream refolded from its prior row with the events before the failing one (reducers are deterministic:
        the state they make is the one the stream had before it), which wait in `parked` with every later one, as a
        gap's do; `quarantined` names the failing event and the error. False: the refold failed too (a reducer that
        is not deterministic), and the error stands: the update fails, as with `stop`."""
        assert self.error is not None and self.seen is not None
        _, failing, event_type, reason = json.loads(self.error)
        again = StreamFold(self.tenant, self.stream_id, self.stream_type, self.reducer, self.skip_unknown)
        again.prior(*self.prior_row)
        before = sorted({e[0]: e for e in self.seen if e[0] < failing}.values())
        again.events(iter(before))
        if again.error is not None:
            return False
        waiting = sorted({e[0]: e for e in self.seen if e[0] >= failing}.values())
        for name in ("state", "version", "last_at", "skipped", "folded", "last_type", "trail", "history_from",
                     "history_at"):
            setattr(self, name, getattr(again, name))
        self.parked = [*again.parked, *({"version": v, "event_type": t, "payload": p, "recorded_at": _timestamp(at)}
                                         for v, t, p, at in waiting)]
        self.error = None
        held = self.held if self.held is not None and self.held.get("version") == failing else None
        self.quarantined = {  # the same failing event as the prior row's: retried, and it fails again
            "version": failing, "event_type": event_type, "kind": self.kind or "Exception", "message": reason,
            "since": held["since"] if held else datetime.now(UTC).isoformat(timespec="seconds"),
            "retries": held.get("retries", 0) + 1 if held else 0}
        return True

    def _row(self, with_trail: bool) -> tuple[Any, ...]:
        state = None
        if self.error is None:
            self._settle(self.state)
        if self.fold is not None and self.error is None:
            try:
                state = self.codec.dumps(self.state)
            except state_json.StateMisfit as misfit:
                self.error = json.dumps([self.stream_id, self.version, self.last_type or "?", str(misfit)])
                self.kind = "StateMisfit"
        trail = self.trail
        return (
            self.stream_id, self.stream_type, self.version, state, self.last_at,
            self.reducer.revision if self.reducer else 0,
            json.dumps(self.parked, default=str) if self.parked else None,
            self.skipped, self.folded, self.error, self.tenant,
            (trail[-1][0] if trail else self.history_from) if trail is not None else None,
            self.history_at if trail is not None else None,
            self._history() if self.error is None and with_trail else None,
            None if self.quarantined is None else json.dumps(self.quarantined),
        )


_OUT_BATCH_ROWS = 5_000
_IN_COLUMNS = ("stream_id", "tenant", "stream_type", "version", "event_type", "payload", "is_prior", "prior_skipped",
               "prior_history_from", "prior_quarantined")


def fold_partitions(registry: dict[str, Reducer], skip_unknown: bool,  # type: ignore[no-untyped-def]
                    quarantine: bool = False):
    """The fold as a `mapInArrow` function, shipped to the Python workers with the reducers captured.

    Its input is partitioned by stream and sorted by (stream, prior row first, version), so one
    pass over the Arrow batches meets each stream's rows together, in order: plain Python per
    event, one Arrow batch out per few thousand streams (no pandas frame per stream).
    """

    def run(batches):  # type: ignore[no-untyped-def]
        schema = FOLD_OUT
        out: list[tuple[Any, ...]] = []
        current: StreamFold | None = None
        sid_now = tenant_now = None

        def flush() -> Any:
            batch = fold_out_batch(out, schema)
            out.clear()
            return batch

        for batch in batches:
            n = batch.num_rows
            at = batch.column("recorded_at").cast(pa.int64()).to_pylist()
            # A batch without the prior-row columns (lake/state/whole_fold.py: no state yet) has only events.
            columns = [batch.column(name).to_pylist() if name in batch.schema.names else repeat(None, n)
                       for name in _IN_COLUMNS]
            history_at = batch.column("prior_history_at").cast(pa.int64()).to_pylist() \
                if "prior_history_at" in batch.schema.names else repeat(None, n)
            for sid, tenant, stype, version, event_type, payload, is_prior, prior_skipped, history_from, held, \
                    recorded_at, prior_at in zip(*columns, at, history_at, strict=True):
                if sid != sid_now or tenant != tenant_now:
                    if current is not None:
                        out.append(current.row())
                        if len(out) >= _OUT_BATCH_ROWS:
                            yield flush()
                    sid_now, tenant_now = sid, tenant
                    current = StreamFold(tenant, sid, stype, registry.get(stype), skip_unknown, quarantine)
                    fold_event = current.event
                if is_prior:
                    current.prior(payload, version, recorded_at, prior_skipped,  # type: ignore[union-attr]
                                  history_from, prior_at, held)
                else:
                    fold_event(version, event_type, payload, recorded_at)
        if current is not None:
            out.append(current.row())
        if out:
            yield flush()

    return run


def fold_out_batch(rows: list[tuple[Any, ...]], schema: pa.Schema = FOLD_OUT) -> pa.RecordBatch:
    """The rows of `StreamFold.row` as one Arrow batch of the fold's output schema."""
    columns = list(zip(*rows, strict=True))
    return pa.RecordBatch.from_arrays(
        [pa.array(list(col), type=f.type) for col, f in zip(columns, schema, strict=True)], schema=schema)


def arrow_updates(out: pa.Table) -> pa.Table:
    """The rows to commit from a fold done in this process (the small increment's, the first build's): its
    first error raised as `ReducerError`, else its rows without the fold's own columns, stamped now."""
    errors = pc.drop_null(out["error"])
    if len(errors):
        stream_id, version, event_type, reason = json.loads(pc.min(errors).as_py())
        raise ReducerError(stream_id, version, event_type, reason)
    rows = out.drop_columns(["error", "folded", "history"])
    if "quarantined" not in rows.column_names:  # the fold of a release before quarantine (a test's frozen output)
        rows = rows.append_column("quarantined", pa.nulls(rows.num_rows, pa.string()))
    return rows.append_column("updated_at", pa.array([datetime.now(UTC)] * out.num_rows, UTC_MICROS)) \
        .select(STATE_SCHEMA.names)


def arrow_result(out: pa.Table, events_version: int, previous: int, *, history_rows: Mapping[str, int] | None = None,
                 held_types: Iterable[str] = ()) -> Result:
    """The figures of a fold done in this process."""
    parked = int(pc.sum(pc.is_valid(out["parked"])).as_py() or 0)
    without = int(pc.sum(pc.equal(out["revision"], 0)).as_py() or 0)
    return state_result(events_version, previous, int(pc.sum(out["folded"]).as_py() or 0), out.num_rows, parked,
                        int(pc.sum(out["skipped"]).as_py() or 0), without, history_rows=history_rows,
                        held_types=held_types, quarantined=int(pc.sum(pc.is_valid(out["quarantined"])).as_py() or 0))


def stale_types(kinds: Any, domain: Domain) -> list[str]:
    """The stream types of (stream_type, revision) pairs that `stream_state` holds whose reducer's revision is no
    longer the row's: a bumped, added (rows of revision 0) or removed reducer (rows of its revision, now none).
    They are rebuilt from `events`, each type alone."""
    revisions = domain.revisions()
    return sorted({t for t, r in kinds if revisions.get(t, 0) != (r or 0)})



def read_columns(domain: Domain) -> list[str]:
    """The `events` columns a fold by `domain` reads: `READ_COLUMNS`, and `metadata` where the domain reads its
    schema versions from there (`Domain(schema_version="metadata:<name>")`), only then."""
    return [*READ_COLUMNS, "metadata"] if domain.metadata_field is not None else list(READ_COLUMNS)


def with_schema_versions(rows: pa.Table, domain: Domain) -> pa.Table:
    """`rows` without `metadata`, their event types carrying the version their metadata names as a suffix where
    `domain` reads versions from there (`Domain.versioned_type`): what the upcasters then read."""
    if domain.metadata_field is None or "metadata" not in rows.column_names:
        return rows.drop_columns(["metadata"]) if "metadata" in rows.column_names else rows
    types = [domain.versioned_type(t, _metadata(m)) for t, m in zip(
        rows["event_type"].to_pylist(), rows["metadata"].to_pylist(), strict=True)]
    i = rows.column_names.index("event_type")
    return rows.set_column(i, "event_type", pa.array(types, pa.string())).drop_columns(["metadata"])


def _metadata(text: str | None) -> Any:
    if not text:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None  # metadata that is not JSON names no version: version 1


def fold_input(new: pa.Table, prior: pa.Table) -> pa.Table:
    """The fold's rows, as the Spark path builds them: new events, the parked ones, and each touched
    stream's prior row (its state in `payload`, marked `is_prior`), sorted by stream, prior first, version."""
    schema = pa.schema([("stream_id", pa.string()), ("stream_type", pa.string()), ("version", pa.int32()),
                        ("event_type", pa.string()), ("payload", pa.string()),
                        ("recorded_at", UTC_MICROS), ("tenant", pa.string()),
                        ("prior_skipped", pa.int32()), ("is_prior", pa.bool_()),
                        ("prior_history_from", pa.int32()), ("prior_history_at", UTC_MICROS),
                        ("prior_quarantined", pa.string())])
    events = new.cast(pa.schema([schema.field(c) for c in FOLD_COLUMNS]))
    n = events.num_rows
    parts = [events.append_column("prior_skipped", pa.nulls(n, pa.int32()))
             .append_column("is_prior", pa.array([False] * n))
             .append_column("prior_history_from", pa.nulls(n, pa.int32()))
             .append_column("prior_history_at", pa.nulls(n, UTC_MICROS))
             .append_column("prior_quarantined", pa.nulls(n, pa.string()))]
    p = prior.to_pydict()
    parked: list[tuple[Any, ...]] = []
    for tenant, sid, stype, text in zip(p["tenant"], p["stream_id"], p["stream_type"], p["parked"], strict=True):
        for e in json.loads(text) if text else ():
            at = None if e["recorded_at"] is None else datetime.fromisoformat(str(e["recorded_at"]))
            parked.append((sid, stype, e["version"], e["event_type"], e["payload"],
                           at if at is None or at.tzinfo else at.replace(tzinfo=UTC), tenant, None, False, None, None,
                           None))
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
        **{f"prior_{c}": had[c] if c in had.column_names else pa.nulls(had.num_rows, schema.field(f"prior_{c}").type)
           for c in LATER_COLUMNS},
    }, schema=schema))
    rows = pa.concat_tables([t.cast(schema) for t in parts])
    return rows.sort_by([("tenant", "ascending"), ("stream_id", "ascending"), ("is_prior", "descending"),
                         ("version", "ascending")])
