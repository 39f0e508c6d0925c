"""Quarantine in the per-stream fold (docs/decisions/0051, step 1): a stream whose reducer fails keeps its last good
state, exactly the fold of its events before the failing one, and parks that event and every later one; the next
fold that gives them again, with a fixed reducer, ends where a fold that never failed ends. Pure logic: no Spark, no
Postgres."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from shop.domain import domain as SHOP

from es_pipeline.domain import Event, Reducer
from es_pipeline.lake.state.fold import StreamFold

ACCOUNT = SHOP.reducers["account"]
Ev = tuple[int, str, str, int | None]


def _mutates_then_fails(state: dict, event: Event) -> dict:
    """Changes the state in place, then raises on a `Boom`: what the fold holds at the failure is not a good state."""
    had = dict(state)
    state["balance"] = -999.0
    if event.event_type == "Boom":
        raise ValueError("the reducer cannot take it")
    state.clear()
    state.update(had)
    return ACCOUNT.fold(state, event)


def _fixed(state: dict, event: Event) -> dict:
    return ACCOUNT.fold(state, event) if event.event_type != "Boom" else state


def _reducer(fold: Any) -> Reducer:
    return Reducer("account", 1, fold, state=ACCOUNT.state, history=ACCOUNT.history)


def _events(rng: random.Random, n: int) -> list[Ev]:
    out: list[Ev] = [(1, "Opened", json.dumps({"owner": "o", "currency": "EUR"}), 86_400_000_000)]
    for v in range(2, n + 1):
        out.append((v, "Deposited", json.dumps({"amount": rng.randint(1, 9)}), 86_400_000_000 * (1 + v // 3)))
    return out


def _fold(reducer: Reducer, events: list[Ev], prior: tuple[Any, ...] | None = None, *, quarantine: bool,
          as_a_run: bool = True) -> tuple[StreamFold, tuple[Any, ...]]:
    fold = StreamFold("t", "a-1", "account", reducer, False, quarantine=quarantine)
    if prior is not None:
        fold.prior(*prior)
    if as_a_run:
        fold.events(iter(events))
    else:
        for e in events:
            fold.event(*e)
    return fold, fold.row()


def _prior(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """A row as the next update's prior: (state, version, last event time, skipped, history_from, history_at)."""
    at = row[4]
    micros = None if at is None else int(at.timestamp() * 1_000_000) if hasattr(at, "timestamp") else at
    history_at = row[12]
    return row[3], row[2], micros, row[7], row[11], history_at


@pytest.mark.parametrize("as_a_run", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_a_failing_event_quarantines_its_stream_at_its_last_good_state(seed: int, as_a_run: bool) -> None:
    rng = random.Random(seed)
    events = _events(rng, rng.randint(3, 40))
    at = rng.randint(2, len(events))
    poisoned = [e if e[0] != at else (at, "Boom", "{}", e[3]) for e in events]
    fold, row = _fold(_reducer(_mutates_then_fails), poisoned, quarantine=True, as_a_run=as_a_run)
    good, expected = _fold(_reducer(_mutates_then_fails), events[:at - 1], quarantine=False)
    assert row[9] is None, "no error: the stream is quarantined, the update goes on"
    held = dict(fold.quarantined or {})
    assert held.pop("since") and {"version": at, "event_type": "Boom", "kind": "ValueError", "retries": 0,
                                  "message": "ValueError: the reducer cannot take it"} == held
    assert json.loads(row[14]) == fold.quarantined, "the row says it is quarantined"
    assert row[2] == at - 1 and row[3] == expected[3], "the state of the events before the failing one"
    assert list(fold.history_rows()) == list(good.history_rows()), "the history ends at the last good state"
    assert [p["version"] for p in json.loads(row[6])] == list(range(at, len(events) + 1)), "the rest waits"

    stopped, stop_row = _fold(_reducer(_mutates_then_fails), poisoned, quarantine=False, as_a_run=as_a_run)
    assert stop_row[9] is not None and stopped.quarantined is None, "without quarantine: the error stops the update"

    # The next update gives the parked events again (as every path does), with a reducer that handles them: the
    # stream ends where a fold that never failed ends.
    parked = [(p["version"], p["event_type"], p["payload"], None) for p in json.loads(row[6])]
    _, retried = _fold(_reducer(_fixed), parked, _prior(row), quarantine=True)
    _, never = _fold(_reducer(_fixed), poisoned, quarantine=True)
    assert retried[9] is None and retried[6] is None and (retried[2], retried[3]) == (never[2], never[3])


def test_a_stream_failing_again_on_a_later_update_keeps_its_prior_state_and_every_event_waits() -> None:
    events = _events(random.Random(1), 10)
    _, first = _fold(_reducer(_mutates_then_fails), events[:6], quarantine=True)
    later = [*events[6:8], (9, "Boom", "{}", None), events[9]]
    fold, row = _fold(_reducer(_mutates_then_fails), later, _prior(first), quarantine=True)
    _, expected = _fold(_reducer(_mutates_then_fails), events[:8], quarantine=False)
    assert fold.quarantined is not None and fold.quarantined["version"] == 9
    assert (row[2], row[3]) == (8, expected[3])
    assert [p["version"] for p in json.loads(row[6])] == [9, 10]


def test_a_gap_before_the_failing_event_parks_as_a_gap_does() -> None:
    events = _events(random.Random(2), 8)
    with_gap = [e for e in events if e[0] != 4]
    poisoned = [e if e[0] != 6 else (6, "Boom", "{}", e[3]) for e in with_gap]
    fold, row = _fold(_reducer(_mutates_then_fails), poisoned, quarantine=True)
    assert fold.quarantined is None, "event 6 waits for 4: it was never folded, so nothing failed"
    assert row[2] == 3 and [p["version"] for p in json.loads(row[6])] == [5, 6, 7, 8]


def test_a_retry_that_fails_again_counts_it_and_keeps_since_when() -> None:
    events = _events(random.Random(3), 6)
    poisoned = [e if e[0] != 4 else (4, "Boom", "{}", e[3]) for e in events]
    _, first = _fold(_reducer(_mutates_then_fails), poisoned, quarantine=True)
    since = json.loads(first[14])["since"]
    parked = [(p["version"], p["event_type"], p["payload"], None) for p in json.loads(first[6])]
    for retries in (1, 2):
        fold, again = _fold(_reducer(_mutates_then_fails), parked, (*_prior(first), first[14]), quarantine=True)
        held = json.loads(again[14])
        assert (held["version"], held["since"], held["retries"]) == (4, since, retries)
        assert (again[2], again[3]) == (first[2], first[3]), "still its last good state"
        first = again
    _, fixed = _fold(_reducer(_fixed), parked, (*_prior(first), first[14]), quarantine=True)
    assert fixed[14] is None and fixed[6] is None and fixed[2] == 6, "it folds now: no longer quarantined"


@pytest.mark.parametrize("payload", ['{"amount": 1', None], ids=["cut-short", "null"])
@pytest.mark.parametrize("as_a_run", [True, False])
def test_a_payload_that_is_not_json_quarantines_its_stream_and_stops_it_without_quarantine(
        as_a_run: bool, payload: str | None) -> None:
    events = _events(random.Random(4), 5)
    broken = [e if e[0] != 3 else (3, "Deposited", payload, e[3]) for e in events]
    fold, row = _fold(_reducer(ACCOUNT.fold), broken, quarantine=True, as_a_run=as_a_run)
    _, expected = _fold(_reducer(ACCOUNT.fold), events[:2], quarantine=False)
    assert fold.quarantined is not None and (fold.quarantined["version"], fold.quarantined["kind"]) == (
        3, "PayloadNotJson")
    assert (row[2], row[3]) == (2, expected[3])
    _, stopped = _fold(_reducer(ACCOUNT.fold), broken, quarantine=False, as_a_run=as_a_run)
    assert "the payload is not JSON" in json.loads(stopped[9])[3]


@pytest.mark.parametrize("returned", [None, [1, 2], "open", 5])
def test_a_reducer_that_returns_no_state_quarantines_its_stream_at_the_last_good_one(returned: Any) -> None:
    def sloppy(state: dict, event: Event) -> Any:
        return returned if event.version == 4 else ACCOUNT.fold(state, event)

    events = _events(random.Random(5), 4)
    fold, row = _fold(Reducer("account", 1, sloppy), events, quarantine=True)
    _, expected = _fold(Reducer("account", 1, ACCOUNT.fold), events[:3], quarantine=False)
    assert fold.quarantined is not None and (fold.quarantined["version"], fold.quarantined["kind"]) == (
        4, "StateMisfit")
    assert "a state is a dict" in fold.quarantined["message"]
    assert (row[2], row[3], row[9]) == (3, expected[3], None)


def test_a_reducer_that_raises_on_every_event_quarantines_each_stream_at_nothing() -> None:
    def broken(state: dict, event: Event) -> dict:
        raise RuntimeError("not deployed right")

    fold, row = _fold(Reducer("account", 1, broken), _events(random.Random(6), 3), quarantine=True)
    assert fold.quarantined is not None and fold.quarantined["version"] == 1
    assert (row[2], row[9]) == (0, None) and [p["version"] for p in json.loads(row[6])] == [1, 2, 3]
