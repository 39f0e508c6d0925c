"""Small increments of the projections (the Arrow paths of lake/state/stream_state.py and lake/aggregates/aggregate.py, and
`follow`): no Spark, delta-rs commits, same tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.dev.workload import run_workload
from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog
from es_pipeline.lake.follow import follow
from es_pipeline.lake.kernel import feed
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.maintenance import compact_with_delta_rs
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.store.conninfo import lock_transaction
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.lake.test_projections import (
    lake_catalog,
    lake_daily,
    same_instants,
    source_catalog,
    source_daily,
)
from es_pipeline_tests.lake.test_stream_state import full_replay, lake_state
from es_pipeline_tests.support.hooks import no_spark
from es_pipeline_tests.support.lakecheck import extract_all
from es_pipeline_tests.support.roles import StoreDsn

PROJECTIONS = ("stream_state", "stream_catalog", "event_type_daily")


def _newest_commit_engine(path: Path) -> str:
    newest = DeltaTable(str(path)).history(1)[0]
    return "delta-rs" if "delta-rs" in str(newest.get("clientVersion", "")) else str(newest.get("engineInfo"))


def _update_all(spark: Any, warehouse: Path, dsn: StoreDsn, small_increments: bool = True) -> list[Any]:
    engine = Engine(spark=spark, small_increments=small_increments)
    return [update_stream_state(engine, warehouse, domain=SHOP, store_dsn=dsn.extractor),
            update_stream_catalog(engine, warehouse, store_dsn=dsn.extractor),
            update_event_type_daily(engine, warehouse, store_dsn=dsn.extractor)]


def test_small_increments_need_no_spark_are_committed_by_delta_rs_and_equal_the_source(
    dsn: StoreDsn, spark: Any, warehouse: Path
) -> None:
    """Spark builds the three tables; then increments, one after a compaction of `events` (its rewrite
    must not count again), are folded and merged without a session; every table equals the store."""
    store = EventStore(dsn.writer)
    run_workload(store, streams=30, events=300, writers=2, rollback_rate=0.1, max_commit_delay=0, seed=1)
    extract_all(dsn.extractor, None, warehouse)
    _update_all(spark, warehouse, dsn, small_increments=False)  # stream_state's would be in-process (whole_fold)
    assert all(_newest_commit_engine(warehouse / t).startswith("Apache-Spark") for t in PROJECTIONS)
    for round_ in range(3):
        moved = 0
        while moved == 0:  # rolled back transactions may leave a round empty
            run_workload(store, streams=40, events=100, writers=2, rollback_rate=0.1, max_commit_delay=0,
                         seed=10 + round_)
            moved = extract_all(dsn.extractor, None, warehouse)
        if round_ == 1:
            compact_with_delta_rs(str(warehouse / "events"), retain_hours=168)
        state, catalog, daily = _update_all(no_spark, warehouse, dsn)
        assert state.events_folded == catalog.events_folded == daily.events_folded == moved
        assert all(_newest_commit_engine(warehouse / t) == "delta-rs" for t in PROJECTIONS)
    expected = full_replay(dsn)
    got = lake_state(spark, warehouse)
    assert {k: (v, s) for k, (v, s, _) in got.items()} == expected
    same_instants(lake_catalog(spark, warehouse), source_catalog(dsn))
    assert lake_daily(spark, warehouse) == source_daily(dsn)
    again = _update_all(no_spark, warehouse, dsn)  # nothing new: nothing read, nothing committed
    assert [r.events_folded for r in again] == [0, 0, 0]


def test_an_increment_over_the_small_limit_goes_to_spark(
    dsn: StoreDsn, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = EventStore(dsn.writer)
    run_workload(store, streams=10, events=50, writers=1, rollback_rate=0, max_commit_delay=0, seed=3)
    extract_all(dsn.extractor, None, warehouse)
    _update_all(spark, warehouse, dsn)
    monkeypatch.setattr(feed, "SMALL_INCREMENT", 40)
    run_workload(store, streams=10, events=50, writers=1, rollback_rate=0, max_commit_delay=0, seed=4)
    extract_all(dsn.extractor, None, warehouse)
    state, catalog, daily = _update_all(spark, warehouse, dsn)
    assert state.events_folded == catalog.events_folded == daily.events_folded == 50
    assert all(_newest_commit_engine(warehouse / t).startswith("Apache-Spark") for t in PROJECTIONS)
    assert {k: (v, s) for k, (v, s, _) in lake_state(spark, warehouse).items()} == full_replay(dsn)


def test_follow_on_a_kept_connection_reads_the_feed_once_for_tables_at_different_versions(
    dsn: StoreDsn, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tailing run's `follow`: the three turns on one connection it keeps, `events`' change feed read once
    when the tables stand at one version, and again from further back when one stands behind; every table
    equals the store, and the connection holds no lock or transaction afterwards."""
    store = EventStore(dsn.writer)
    run_workload(store, streams=20, events=120, writers=2, rollback_rate=0, max_commit_delay=0, seed=5)
    extract_all(dsn.extractor, None, warehouse)
    _update_all(spark, warehouse, dsn)
    reads: list[int] = []
    real = feed.new_rows

    def counted(events: Any, after: int, upto: int, columns: list[str]) -> Any:
        reads.append(after)
        return real(events, after, upto, columns)

    monkeypatch.setattr(feed, "new_rows", counted)
    with lock_transaction(dsn.extractor, application_name="test follow") as conn:
        for seed, behind in ((6, False), (7, True)):
            run_workload(store, streams=20, events=60, writers=2, rollback_rate=0, max_commit_delay=0, seed=seed)
            extract_all(dsn.extractor, None, warehouse)
            if behind:  # stream_state alone moves on: the others now stand a version behind it
                update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP, store_dsn=dsn.extractor)
                run_workload(store, streams=20, events=30, writers=1, rollback_rate=0, max_commit_delay=0, seed=8)
                extract_all(dsn.extractor, None, warehouse)
            reads.clear()
            done = follow(warehouse, conn, SHOP)
            assert set(done) == set(PROJECTIONS)
            assert len(reads) == (2 if behind else 1), reads
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            assert conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                                "AND pid = pg_backend_pid()").fetchone() == (0,)
            conn.rollback()
    assert {k: (v, s) for k, (v, s, _) in lake_state(spark, warehouse).items()} == full_replay(dsn)
    same_instants(lake_catalog(spark, warehouse), source_catalog(dsn))
    assert lake_daily(spark, warehouse) == source_daily(dsn)
