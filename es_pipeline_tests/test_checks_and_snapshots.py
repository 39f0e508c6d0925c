"""Asset checks have teeth (fail on a broken table, pass on a good one); snapshots make `load` = replay."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import dagster as dg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from es_pipeline import checks
from es_pipeline.demo import DemoStream, next_events, run_workload
from es_pipeline.event_store import EventStore, RecordedEvent
from es_pipeline.extract import Extractor
from es_pipeline.reducers import REGISTRY, Event
from es_pipeline.resources import EventStoreResource, SparkResource, WarehouseResource
from es_pipeline.settings import Settings
from es_pipeline.slices import SliceRange
from es_pipeline.snapshots import take_snapshots
from es_pipeline.spark import spark_conf
from es_pipeline.state import update_stream_state


def _resources(s: Settings) -> dict[str, Any]:
    return {
        "spark": SparkResource(spark_config=spark_conf(s)),
        "warehouse": WarehouseResource(path=str(s.warehouse)),
        "event_store": EventStoreResource(dsn=s.pg_dsn),
    }


def _run(check: Any, r: dict[str, Any]) -> dg.AssetCheckResult:
    names = check.node_def.required_resource_keys if hasattr(check, "node_def") else set()
    return check(**{k: v for k, v in r.items() if k in names})


def test_checks_pass_on_a_good_lake_and_fail_on_broken_ones(settings: Settings, spark: Any, warehouse: Path) -> None:
    run_workload(EventStore(settings.pg_dsn), streams=40, events=300, writers=2, rollback_rate=0, max_commit_delay=0)
    Extractor(settings.pg_dsn, spark, warehouse).run(SliceRange(0, 1023))
    update_stream_state(spark, warehouse)
    r = _resources(settings)
    for check in checks.CHECKS:
        assert _run(check, r).passed, check.check_key.name

    events = str(warehouse / "events")
    df = spark.read.format("delta").load(events)
    victim = df.where("version = 1").orderBy("stream_id").first()
    # A duplicate row: the duplicate check fails; reconcile fails too (one more than the source).
    df.where(f"stream_id = '{victim['stream_id']}' AND version = 1").write.format("delta").mode("append").save(events)
    assert not _run(checks.events_no_duplicates, r).passed
    assert not _run(checks.events_reconcile_with_source, r).passed
    # A lost row below the watermark: contiguity and reconcile fail.
    spark.sql(f"DELETE FROM delta.`{events}` WHERE stream_id = '{victim['stream_id']}' AND version = 1")
    assert _run(checks.events_no_duplicates, r).passed
    assert not _run(checks.events_versions_contiguous, r).passed
    assert not _run(checks.events_reconcile_with_source, r).passed
    # A stream_state row behind its events.
    spark.sql(f"UPDATE delta.`{warehouse / 'stream_state'}` SET version = version - 1 WHERE stream_id = '{victim['stream_id']}'")
    assert not _run(checks.stream_state_version_matches_events, r).passed


_examples = itertools.count()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    lengths=st.lists(st.integers(1, 25), min_size=1, max_size=4),
    threshold=st.integers(1, 8),
    split_at=st.floats(0.2, 0.9),
)
def test_load_from_snapshot_plus_later_events_equals_full_replay(
    dsn: str, spark: Any, warehouse: Path, seed: int, lengths: list[int], threshold: int, split_at: float
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
    Extractor(dsn, spark, warehouse).run(SliceRange(0, 1023))
    update_stream_state(spark, warehouse)
    take_snapshots(spark, warehouse, store, threshold=threshold)
    for s, events in zip(streams, plans, strict=True):  # the rest arrives after the snapshot
        rest = events[s.version:]
        if rest:
            s.version = store.append(s.stream_id, s.stream_type, rest, s.version)

    for s in streams:
        reducer = REGISTRY[s.stream_type]

        def fold(state: dict[str, Any], e: RecordedEvent, reducer: Any = reducer) -> dict[str, Any]:
            return reducer.fold(state, Event(e.stream_id, e.version, e.event_type, e.payload))

        replay: dict[str, Any] = {}
        for e in store.read_stream(s.stream_id):
            replay = fold(replay, e)
        state, version = store.load(s.stream_id, fold, revision=reducer.revision)
        assert version == s.version
        assert json.loads(json.dumps(state)) == json.loads(json.dumps(replay))
