"""`StreamFold.events` (a run of a stream's events, the first build's loop) folds exactly as `event` does one
by one (the increments' loop): gaps, duplicates, unknown types skipped or not, missing fields, bad reducers.
Pure logic: no Spark, no Postgres."""

import json
import random

import pytest
from shop.domain import domain as SHOP

from es_pipeline.domain import Event, Reducer
from es_pipeline.lake.state.fold import StreamFold


def _boom(state: dict, event: Event) -> dict:
    if event.event_type == "Boom":
        raise ValueError("no")
    return SHOP.reducers["account"].fold(state, event)


_TYPES = [("Deposited", {"amount": 2.5}), ("Withdrawn", {"amount": 1.25}), ("Frozen", {"amount": 1}),
          ("Deposited", {}), ("Boom", {})]


def _events(rng: random.Random) -> list[tuple[int, str, str, int | None]]:
    """A stream's events in version order, with now and then a gap, a duplicate, an odd type or payload."""
    out = [(1, "Opened", json.dumps({"owner": "o", "currency": "EUR"}), 0)]
    v = 1
    for _ in range(rng.randint(0, 30)):
        v += 1 if rng.random() > 0.1 else rng.choice([0, 2, 3])  # a duplicate, or a gap
        kind, payload = _TYPES[0] if rng.random() > 0.15 else rng.choice(_TYPES)
        out.append((v, kind, json.dumps(payload), v * 1000 if rng.random() > 0.1 else None))
    return out


@pytest.mark.parametrize("skip_unknown", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_a_run_folds_as_one_event_at_a_time(seed: int, skip_unknown: bool) -> None:
    rng = random.Random(seed)
    events = _events(rng)
    reducer = Reducer("account", 3, _boom)
    one_by_one = StreamFold("t", "s-1", "account", reducer, skip_unknown)
    for e in events:
        one_by_one.event(*e)
    as_a_run = StreamFold("t", "s-1", "account", reducer, skip_unknown)
    as_a_run.events(iter(events))
    assert as_a_run.row() == one_by_one.row()


def test_a_run_after_prior_state_and_a_parked_event() -> None:
    """A stream with a prior row and a parked event (an increment's case) goes one by one from the start."""
    reducer = SHOP.reducers["account"]
    rows = []
    for fold in (StreamFold("", "s", "account", reducer, False), StreamFold("", "s", "account", reducer, False)):
        fold.prior(json.dumps({"balance": 1.0, "status": "open"}), 3, 0, 0)
        fold.event(5, "Deposited", json.dumps({"amount": 1}), 5)  # parked: 4 is missing
        rest = [(4, "Deposited", json.dumps({"amount": 2}), 4), (6, "Deposited", json.dumps({"amount": 4}), 6)]
        if not rows:
            for e in rest:
                fold.event(*e)
        else:
            fold.events(iter(rest))
        rows.append(fold.row())
    assert rows[0] == rows[1]


def test_a_stream_type_without_a_reducer_keeps_its_versions_and_times_alone_as_a_run_and_one_by_one() -> None:
    events = [(1, "X", "{}", 10), (2, "Y", "not json", 20), (4, "Z", "{}", 40), (3, "Y", "{}", 30), (5, "X", "{}", 50)]
    one_by_one, as_a_run = StreamFold("", "s", "nobody", None, False), StreamFold("", "s", "nobody", None, False)
    for e in events:
        one_by_one.event(*e)
    as_a_run.events(iter(events))
    assert as_a_run.row() == one_by_one.row()
    row = as_a_run.row()
    # (stream, type, version, state, last event at, revision, parked, skipped, folded, error, tenant)
    assert row[2:6] == (2, None, 20, 0) and json.loads(row[6])[0]["version"] == 4 and row[9] is None
    in_order = StreamFold("", "s", "nobody", None, False)
    in_order.events(iter(sorted(events)))
    assert in_order.row()[2:7] == (5, None, 50, 0, None) and in_order.row()[8] == 5


# -- history: the trail (lake/state/history.py's rows) --------------------------------------------------------------

_HOUR = 3_600_000_000


def _mutating(state: dict, event: Event) -> dict:
    """A reducer that changes its state in place and returns it (allowed: a daily row must still keep its day's
    last state, not the next day's)."""
    state["balance"] = round(float(state.get("balance", 0.0)) + float(event.payload["amount"]), 2)
    state["n"] = int(state.get("n", 0)) + 1
    return state


def _history_events(rng: random.Random) -> list[tuple[int, str, str, int]]:
    """A stream's events in version order, a few hours apart, `recorded_at` now and then going backwards."""
    at, out = rng.randrange(0, 48) * _HOUR, []
    for v in range(1, rng.randint(2, 40)):
        at += rng.choice([0, 1, 2, 5, 13]) * _HOUR if rng.random() > 0.2 else -rng.randrange(0, 6) * _HOUR
        out.append((v, "Deposited", json.dumps({"amount": rng.choice([1.5, 2, -3.25])}), at))
    return out


def _expected_trail(events: list[tuple[int, str, str, int]], grain: str) -> list[tuple[int, int, int, int | None, dict]]:
    """The history a fold of every event gives, computed here: (version_from, version_to, valid_from, valid_to,
    state) with valid_from the running max of recorded_at; daily: each day's last state (day of that max), from
    the day's first change."""
    from datetime import UTC, datetime
    from zoneinfo import ZoneInfo

    zone = ZoneInfo(grain.partition(":")[2] or "UTC")
    state: dict = {}
    high = None
    rows: list[list] = []
    for v, kind, payload, at in events:
        state = _mutating(dict(state), Event("s", v, kind, json.loads(payload)))
        high = at if high is None or at > high else high
        day = datetime.fromtimestamp(high / 1e6, UTC).astimezone(zone).date()
        if grain != "each" and rows and rows[-1][4] == day:
            rows[-1][1], rows[-1][3] = v, dict(state)  # a day's row: from its first change, its last state
        else:
            rows.append([v, v, high, dict(state), day])
    return [(f, t, a, rows[i + 1][2] if i + 1 < len(rows) else None, s) for i, (f, t, a, s, _) in enumerate(rows)]


def _apply(table: dict[int, list], trail: str | None) -> None:
    """A history table (version_from → [version_to, valid_from, valid_to, state]) after one update's trail, as
    the MERGE applies it: the closed row's valid_to set, the new rows inserted or (same key) replacing."""
    if trail is None:
        return
    held = json.loads(trail)
    if held["c"] is not None:
        table[held["c"]][2] = held["r"][0]["a"]
    for r in held["r"]:
        kept = table[r["f"]][1] if r["f"] in table else r["a"]  # a replaced day's row keeps its valid_from
        table[r["f"]] = [r["t"], kept, r["b"], json.loads(r["s"])]


@pytest.mark.parametrize("grain", ["each", "daily:UTC", "daily:Asia/Tokyo"])
@pytest.mark.parametrize("seed", range(25))
def test_the_trail_of_any_split_of_a_stream_into_updates_is_its_history(seed: int, grain: str) -> None:
    """Folded whole (as a run and one by one) or over several updates (each from the prior row's state, version
    and `history_from` / `history_at`, its trail applied as the MERGE does), the history is the one computed here."""
    rng = random.Random(seed)
    events = _history_events(rng)
    reducer = Reducer("account", 1, _mutating, history=grain)
    expected = {f: [t, a, b, s] for f, t, a, b, s in _expected_trail(events, grain)}
    whole, one_by_one = StreamFold("", "s", "account", reducer, False), StreamFold("", "s", "account", reducer, False)
    whole.events(iter(events))
    for e in events:
        one_by_one.event(*e)
    assert whole.row() == one_by_one.row()
    table: dict[int, list] = {}
    _apply(table, whole.row()[13])
    assert table == expected
    table, prior = {}, None
    cuts = sorted(rng.sample(range(1, len(events)), min(3, len(events) - 1))) if len(events) > 1 else []
    for lo, hi in zip([0, *cuts], [*cuts, len(events)], strict=True):
        fold = StreamFold("", "s", "account", reducer, False)
        if prior is not None:
            fold.prior(prior[3], prior[2], prior[4], prior[7], prior[11], prior[12])
        fold.events(iter(events[lo:hi]))
        prior = fold.row()
        _apply(table, prior[13])
    assert table == expected
    # stream_state's history_from / history_at: the current row's first version, the running max so far.
    assert prior is not None and prior[11] == max(expected) and prior[12] == max(at for *_, at in events)
