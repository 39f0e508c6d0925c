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
