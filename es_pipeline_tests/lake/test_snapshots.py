"""Snapshots make `load` = replay: a snapshot plus the events after it folds to the same state."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shop.domain import domain as SHOP

from es_pipeline.dev.workload import DemoStream, next_events
from es_pipeline.domain import Event
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state.snapshots import take_snapshots
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.store.event_store import EventStore, RecordedEvent
from es_pipeline_tests.support.roles import StoreDsn

_examples = itertools.count()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    lengths=st.lists(st.integers(1, 25), min_size=1, max_size=4),
    threshold=st.integers(1, 8),
    split_at=st.floats(0.2, 0.9),
)
def test_load_from_snapshot_plus_later_events_equals_full_replay(
    dsn: StoreDsn, spark: Any, warehouse: Path, seed: int, lengths: list[int], threshold: int, split_at: float
) -> None:
    rng = random.Random(seed)
    store = EventStore(dsn)
    n = next(_examples)
    streams = [DemoStream(f"{rng.choice(['cart', 'account'])}-p{n}-{i}", "") for i in range(len(lengths))]
    for s in streams:
        s.stream_type = s.stream_id.split("-")[0]
    plans = []
    for s, length in zip(streams, lengths, strict=True):
        events, _, _ = next_events(s, rng, length)
        plans.append(events)
    for s, events in zip(streams, plans, strict=True):  # the first part, then extract, fold, snapshot
        k = max(1, int(len(events) * split_at))
        s.version = store.append(s.stream_id, s.stream_type, events[:k], 0)
    Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP)
    take_snapshots(Engine(spark=spark), warehouse, store, threshold=threshold)
    for s, events in zip(streams, plans, strict=True):  # the rest arrives after the snapshot
        rest = events[s.version:]
        if rest:
            s.version = store.append(s.stream_id, s.stream_type, rest, s.version)

    for s in streams:
        reducer = SHOP.folds[s.stream_type]  # behind the shop's upcasters, at the revision the lake records

        def fold(state: dict[str, Any], e: RecordedEvent, reducer: Any = reducer) -> dict[str, Any]:
            return reducer.fold(state, Event(e.stream_id, e.version, e.event_type, e.payload))

        replay: dict[str, Any] = {}
        for e in store.read_stream(s.stream_id):
            replay = fold(replay, e)
        state, version = store.load(s.stream_id, fold, revision=reducer.revision)
        assert version == s.version
        assert json.loads(json.dumps(state)) == json.loads(json.dumps(replay))
