"""Exactly-once extraction, against real Postgres, Spark and Delta, compared event by event."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
from delta.tables import DeltaTable as SparkDeltaTable
from deltalake import DeltaTable

from es_pipeline.dev.workload import bulk_load, run_workload
from es_pipeline.errors import LakeOffsetsMismatch, SinkChanged, SliceLocked
from es_pipeline.extraction import offsets, reader
from es_pipeline.extraction.extractor import UNSAMPLED_BACKLOG, Extractor, build_extractor
from es_pipeline.extraction.offsets import Batch
from es_pipeline.extraction.reader import batch_query
from es_pipeline.extraction.slices import SliceRange, split
from es_pipeline.lake.delta import tables
from es_pipeline.settings import Settings
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.hooks import Crash, crash_at, hold_when_locked, no_spark
from es_pipeline_tests.support.lakecheck import (
    assert_exactly_once,
    assert_exactly_once_by_key,
    extract_all,
    source_events,
)
from es_pipeline_tests.support.roles import StoreDsn

SPARK_WRITER = pytest.mark.spark_writer  # the lake written through Spark: the other PostgreSQL majors skip these


def naive_poll(dsn: StoreDsn, stop: threading.Event, seen: set[tuple[str, int]]) -> None:
    """The broken extractor that reads by sequence, `global_position > last`, polled while writers write."""
    last = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            rows = conn.execute(
                "SELECT global_position, stream_id, version FROM es.events WHERE global_position > %s "
                "ORDER BY global_position", (last,)
            ).fetchall()
            for pos, s, v in rows:
                seen.add((s, v))
                last = max(last, pos)
            if stop.is_set():
                break
            time.sleep(0.005)


# The race is the horizon's (the read): at scale with delta-rs; with the Spark writer, whose commits are the same
# idempotent Delta transactions (its crash drills above), at the size that still races several runs against writers.
# `make test-pg-versions` races the other majors at that size too (ES_PIPELINE_TEST_RACE_EVENTS).
RACE_EVENTS = int(os.environ.get("ES_PIPELINE_TEST_RACE_EVENTS", "4000"))


@pytest.mark.parametrize(("writer", "events"), [("delta-rs", RACE_EVENTS),
                                                 pytest.param("spark", 2000, marks=SPARK_WRITER)])
def test_seed_004_race_at_scale_is_exactly_once_and_the_naive_offset_loses_events(
    dsn: StoreDsn, spark: Any, warehouse: Path, writer: str, events: int
) -> None:
    """8 writers, random commit delays, ~10% rollbacks, extraction running all along (both Delta writers)."""
    stop = threading.Event()
    naive_seen: set[tuple[str, int]] = set()
    naive = threading.Thread(target=naive_poll, args=(dsn, stop, naive_seen))
    report: list[Any] = []
    writers = threading.Thread(
        target=lambda: report.append(run_workload(
            EventStore(dsn), streams=300, events=events, writers=8, rollback_rate=0.1, max_commit_delay=0.1, seed=4
        ))
    )
    ex = Extractor(dsn.extractor, spark, warehouse, writer=writer)
    EventStore(dsn).append("warm-up", "cart", [NewEvent("ItemAdded", {})], 0)
    ex.run(SliceRange(0, 1023))  # warm up: the table exists, Spark has written once
    naive.start()
    writers.start()
    runs_during_writing = 0
    while writers.is_alive():
        for r in split(4):
            if writers.is_alive():
                runs_during_writing += 1
            ex.run(r)
    writers.join()
    stop.set()
    naive.join()
    for r in split(4):
        ex.run(r)
    assert runs_during_writing >= 4, "extraction ran during the writing"
    assert report[0].rollbacks > 0
    n = assert_exactly_once(spark, warehouse, dsn)
    assert n == report[0].events + 1 == events + 1
    lost = set(source_events(dsn)) - naive_seen
    assert lost, "the naive `global_position > last` extractor should have lost events"


def test_rollbacks_and_position_gaps_are_invisible(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    store = EventStore(dsn)
    store.append("a", "cart", [NewEvent("ItemAdded", {"n": 1})], 0)
    with store.connect() as conn, conn.transaction():
        store.append("b", "cart", [NewEvent("ItemAdded", {"n": 2})] * 5, 0, conn=conn)
        raise psycopg.Rollback()
    store.append("a", "cart", [NewEvent("ItemAdded", {"n": 3})], 1)
    with psycopg.connect(dsn) as conn:
        positions = [r[0] for r in conn.execute("SELECT global_position FROM es.events ORDER BY 1")]
    assert positions[1] - positions[0] > 1, "the rollback left a gap in global_position"
    assert extract_all(dsn.extractor, spark, warehouse, 8) == 2
    assert assert_exactly_once(spark, warehouse, dsn) == 2


@pytest.mark.parametrize(
    ("step", "crashed_writer", "rerun_writer"),
    [
        ("read", "delta-rs", "delta-rs"),
        ("delta_committed", "delta-rs", "delta-rs"),
        # A commit by either writer is seen by the other.
        pytest.param("delta_committed", "spark", "delta-rs", marks=SPARK_WRITER),
        pytest.param("delta_committed", "delta-rs", "spark", marks=SPARK_WRITER),
    ],
)
def test_crash_at_a_step_then_rerun_is_exactly_once(
    dsn: StoreDsn, spark: Any, warehouse: Path, step: str, crashed_writer: str, rerun_writer: str
) -> None:
    run_workload(EventStore(dsn), streams=50, events=800, writers=4, rollback_rate=0.1, max_commit_delay=0, seed=1)
    r = SliceRange(0, 1023)
    with pytest.raises(Crash):
        Extractor(dsn.extractor, spark, warehouse, writer=crashed_writer, on_step=crash_at(step)).run(r)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM es_pipeline.pending_batches").fetchone() == (1,)
    result = Extractor(dsn.extractor, spark, warehouse, writer=rerun_writer).run(r)
    assert result.replayed_batches == 1
    assert assert_exactly_once(spark, warehouse, dsn) == 800
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM es_pipeline.pending_batches").fetchone() == (0,)


def test_crash_midway_through_a_multi_interval_backfill(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    bulk_load(dsn, events=5000, streams=100, events_per_tx=250)
    r = SliceRange(0, 1023)
    with pytest.raises(Crash):
        Extractor(dsn.extractor, spark, warehouse, batch_events=1000, on_step=crash_at("delta_committed", nth=3)).run(r)
    result = Extractor(dsn.extractor, spark, warehouse, batch_events=1000).run(r)
    assert result.replayed_batches == 1
    assert result.batches >= 2
    assert max(result.batch_rows) <= 1500, "intervals stay near the target size"
    assert assert_exactly_once(spark, warehouse, dsn) == 5000


def test_the_jdbc_read_path_is_exactly_once_too(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    """Large batches can be read by Spark's executors over JDBC, bounded by the same fixed H."""
    bulk_load(dsn, events=3000, streams=100, events_per_tx=500)
    r = SliceRange(0, 1023)
    with pytest.raises(Crash):
        Extractor(dsn.extractor, spark, warehouse, batch_events=1000, jdbc_min_rows=1,
                  on_step=crash_at("delta_committed", nth=2)).run(r)
    result = Extractor(dsn.extractor, spark, warehouse, batch_events=1000, jdbc_min_rows=1).run(r)
    assert result.replayed_batches == 1
    assert assert_exactly_once(spark, warehouse, dsn) == 3000


def test_a_lost_lake_is_refused_not_silently_half_filled(dsn: StoreDsn, spark: Any, warehouse: Path, tmp_path: Path) -> None:
    run_workload(EventStore(dsn), streams=20, events=100, writers=2, rollback_rate=0, max_commit_delay=0)
    Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))
    new_lake = tmp_path / "moved"
    with pytest.raises(LakeOffsetsMismatch, match="es-pipeline lake rebuild"):
        Extractor(dsn.extractor, spark, new_lake).run(SliceRange(0, 1023))
    with psycopg.connect(dsn) as conn:
        offsets.reset(conn, "events")
    Extractor(dsn.extractor, spark, new_lake).run(SliceRange(0, 1023))
    assert assert_exactly_once(spark, new_lake, dsn) == 100


def test_a_lost_lake_is_refused_for_offsets_older_than_the_sink_record(
    dsn: StoreDsn, spark: Any, warehouse: Path, tmp_path: Path
) -> None:
    """Offsets written before es_pipeline.sinks existed (no record): a run that creates the table refuses."""
    run_workload(EventStore(dsn), streams=20, events=100, writers=2, rollback_rate=0, max_commit_delay=0)
    Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))
    with psycopg.connect(dsn) as conn:
        conn.execute("DELETE FROM es_pipeline.sinks")
    with pytest.raises(LakeOffsetsMismatch, match="was just created"):
        Extractor(dsn.extractor, spark, tmp_path / "moved").run(SliceRange(0, 1023))
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM es_pipeline.sinks").fetchone() == (0,), "nothing recorded"
    Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))  # the old lake is recorded on its next run
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT path FROM es_pipeline.sinks").fetchone() == (str(warehouse / "events"),)


def test_a_lost_lake_stays_refused_on_the_run_after_the_refusal(dsn: StoreDsn, spark: Any, warehouse: Path, tmp_path: Path) -> None:
    """The refused run created the new (empty) table: the next run must not take it for the lake."""
    run_workload(EventStore(dsn), streams=20, events=100, writers=2, rollback_rate=0, max_commit_delay=0)
    Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))
    with psycopg.connect(dsn) as conn:
        conn.execute("DELETE FROM es_pipeline.sinks")  # offsets older than the sink record
    for _ in range(2):
        with pytest.raises(LakeOffsetsMismatch):
            Extractor(dsn.extractor, spark, tmp_path / "moved").run(SliceRange(0, 1023))


def test_a_lake_recreated_by_another_range_is_refused(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    """The lake is lost after one range was extracted; another range (no watermarks yet) recreates the
    table. The first range must not then continue from its watermarks into the new table, which lacks
    its earlier events: the recorded table id tells the two tables apart."""
    run_workload(EventStore(dsn), streams=40, events=200, writers=2, rollback_rate=0, max_commit_delay=0)
    low, high = SliceRange(0, 511), SliceRange(512, 1023)
    Extractor(dsn.extractor, spark, warehouse).run(low)

    first_id = tables.table_id(str(warehouse / "events"))
    assert first_id == DeltaTable(str(warehouse / "events")).metadata().id  # read from the first commit alone
    shutil.rmtree(warehouse / "events")
    with pytest.raises(LakeOffsetsMismatch, match="not the one es_pipeline.offsets describes"):
        Extractor(dsn.extractor, spark, warehouse).run(high)  # creates the new table, then refuses
    with pytest.raises(LakeOffsetsMismatch, match="es-pipeline lake rebuild"):
        Extractor(dsn.extractor, spark, warehouse).run(low)  # the table exists now: refused all the same
    with psycopg.connect(dsn) as conn:
        offsets.reset(conn, "events")
    Extractor(dsn.extractor, spark, warehouse).run(low)
    Extractor(dsn.extractor, spark, warehouse).run(high)
    assert assert_exactly_once(spark, warehouse, dsn) == 200
    assert tables.table_id(str(warehouse / "events")) != first_id


def test_a_moved_lake_is_the_same_lake(dsn: StoreDsn, spark: Any, warehouse: Path, tmp_path: Path) -> None:
    """Moving the warehouse keeps the table id: the run goes on from the watermarks, and the new path is recorded."""
    store = EventStore(dsn)
    run_workload(store, streams=20, events=100, writers=2, rollback_rate=0, max_commit_delay=0)
    Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))
    moved = tmp_path / "moved"
    shutil.move(str(warehouse), str(moved))
    run_workload(store, streams=20, events=50, writers=2, rollback_rate=0, max_commit_delay=0, seed=7)
    assert Extractor(dsn.extractor, spark, moved).run(SliceRange(0, 1023)).rows == 50
    assert assert_exactly_once(spark, moved, dsn) == 150
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT path FROM es_pipeline.sinks").fetchone() == (str(moved / "events"),)


def test_a_sink_rebound_mid_run_commits_nothing_and_the_batch_is_replayed(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    """Another run binds the consumer to another table while this one writes: no watermark moves, the
    batch stays pending, and the next run replays it into the table bound then, exactly once."""
    run_workload(EventStore(dsn), streams=20, events=100, writers=2, rollback_rate=0, max_commit_delay=0)

    def rebind(name: str, batch: Batch | None) -> None:
        if name == "delta_committed":
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("UPDATE es_pipeline.sinks SET table_id = 'another-table'")

    with pytest.raises(SinkChanged, match="replays it"):
        Extractor(dsn.extractor, spark, warehouse, on_step=rebind).run(SliceRange(0, 1023))
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM es_pipeline.offsets").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM es_pipeline.pending_batches").fetchone() == (1,)
    result = Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))  # no watermark yet: it rebinds
    assert result.replayed_batches == 1
    assert assert_exactly_once(spark, warehouse, dsn) == 100


def test_offsets_reset_waits_for_running_extractions(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    run_workload(EventStore(dsn), streams=20, events=100, writers=2, rollback_rate=0, max_commit_delay=0)
    holding, release = threading.Event(), threading.Event()
    hold = hold_when_locked(holding, release)
    running = threading.Thread(target=lambda: Extractor(dsn.extractor, spark, warehouse, on_step=hold).run(split(8)[3]))
    running.start()
    assert holding.wait(60)
    try:
        with pytest.raises(SliceLocked):
            offsets.reset_when_idle(dsn, "events")
    finally:
        release.set()
        running.join()
    assert offsets.reset_when_idle(dsn, "events") == 128  # the run's slices, now forgotten


def test_replaying_a_committed_batch_writes_nothing(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    """Delta's txnAppId/txnVersion: the same batch appended twice lands once."""
    run_workload(EventStore(dsn), streams=20, events=200, writers=2, rollback_rate=0, max_commit_delay=0)
    with pytest.raises(Crash):
        Extractor(dsn.extractor, spark, warehouse, on_step=crash_at("delta_committed")).run(SliceRange(0, 1023))
    version_before = SparkDeltaTable.forPath(spark, str(warehouse / "events")).history(1).first()["version"]
    Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))
    version_after = SparkDeltaTable.forPath(spark, str(warehouse / "events")).history(1).first()["version"]
    assert version_after == version_before, "the replay was skipped by Delta, no new commit"
    assert assert_exactly_once(spark, warehouse, dsn) == 200


def test_long_open_transaction_holds_the_horizon_and_loses_nothing(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    store = EventStore(dsn)
    long_tx = store.connect()
    long_tx.execute("BEGIN")
    store.append("slow", "cart", [NewEvent("ItemAdded", {"sku": "slow"})], 0, conn=long_tx)
    run_workload(store, streams=20, events=300, writers=2, rollback_rate=0, max_commit_delay=0)
    time.sleep(0.2)
    ex = Extractor(dsn.extractor, spark, warehouse)
    first = ex.run(SliceRange(0, 1023))
    assert first.rows == 0, "everything after the open transaction waits behind the horizon"
    assert first.events_behind == 300
    assert first.oldest_open_tx_seconds > 0.1
    long_tx.execute("COMMIT")
    long_tx.close()
    second = ex.run(SliceRange(0, 1023))
    assert second.rows == 301 and second.events_behind == 0
    assert assert_exactly_once(spark, warehouse, dsn) == 301


def test_prepared_transaction_holds_the_horizon_too(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    """A prepared (two-phase) transaction keeps its xid open: H stays below it until COMMIT PREPARED.

    It writes a snapshot row, not events: a transaction that executed NOTIFY (every append does)
    cannot be prepared, a PostgreSQL rule noted in docs/decisions.md.
    """
    store = EventStore(dsn)
    with store.connect() as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO es.snapshots (stream_id, stream_type, version, state, revision) "
                     "VALUES ('p', 'cart', 0, '{}', 1)")
        conn.execute("PREPARE TRANSACTION 'es_test_prepared'")
    try:
        store.append("later", "cart", [NewEvent("ItemAdded", {})], 0)
        time.sleep(0.2)
        result = Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))
        assert result.rows == 0 and result.events_behind == 1 and result.oldest_open_tx_seconds > 0.1
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("COMMIT PREPARED 'es_test_prepared'")
    assert Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023)).rows == 1
    assert assert_exactly_once(spark, warehouse, dsn) == 1


def test_reslicing_8_16_4_reads_every_slice_once(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    store = EventStore(dsn)
    read = 0
    for i, n in enumerate((8, 16, 4)):
        run_workload(store, streams=100, events=700, writers=4, rollback_rate=0.1, max_commit_delay=0.01, seed=i)
        read += extract_all(dsn.extractor, spark, warehouse, n)
    total = assert_exactly_once(spark, warehouse, dsn)
    assert total == 2100
    assert read == total, "rows read across the splits add up to the total: no slice was read twice"


def test_a_batch_left_pending_by_one_split_is_replayed_by_another(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    store = EventStore(dsn)
    run_workload(store, streams=100, events=600, writers=2, rollback_rate=0, max_commit_delay=0)
    with pytest.raises(Crash):
        Extractor(dsn.extractor, spark, warehouse, on_step=crash_at("delta_committed")).run(split(16)[1])
    result = Extractor(dsn.extractor, spark, warehouse).run(split(4)[0])  # 0000-0255 covers 0064-0127
    assert result.replayed_batches == 1
    extract_all(dsn.extractor, spark, warehouse, 4)
    assert assert_exactly_once(spark, warehouse, dsn) == 600


def test_a_second_run_on_an_overlapping_range_fails_fast_and_writes_nothing(
    dsn: StoreDsn, spark: Any, warehouse: Path
) -> None:
    run_workload(EventStore(dsn), streams=50, events=500, writers=2, rollback_rate=0, max_commit_delay=0)
    holding = threading.Event()
    release = threading.Event()
    hold = hold_when_locked(holding, release)
    first = threading.Thread(target=lambda: Extractor(dsn.extractor, spark, warehouse, on_step=hold).run(split(8)[0], run_id="run-A"))
    first.start()
    assert holding.wait(60)
    try:
        started = time.monotonic()
        with pytest.raises(SliceLocked) as info:
            Extractor(dsn.extractor, spark, warehouse).run(SliceRange(100, 200), run_id="run-B")
        assert time.monotonic() - started < 5
        message = str(info.value)
        assert "0100-0200" in message and "run-A" in message
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT count(*) FROM es_pipeline.offsets WHERE run_id = 'run-B'").fetchone() == (0,)
            assert conn.execute("SELECT count(*) FROM es_pipeline.pending_batches").fetchone() == (0,)
    finally:
        release.set()
        first.join()
    extract_all(dsn.extractor, spark, warehouse, 8)
    assert assert_exactly_once(spark, warehouse, dsn) == 500


@pytest.mark.parametrize("uniform", [True, False], ids=["one-watermark", "per-slice-watermarks"])
def test_incremental_read_probes_the_slice_index(dsn: StoreDsn, uniform: bool) -> None:
    """On a table large enough for the planner to care, an incremental batch is index probes, not a scan."""
    bulk_load(dsn, events=200_000, streams=2000, events_per_tx=50_000)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE es.events")
        row = conn.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint").fetchone()
        assert row is not None
        horizon = int(row[0])
        tx = [int(r[0]) for r in conn.execute("SELECT DISTINCT tx_id::text::bigint FROM es.events ORDER BY 1")]
        recent = tx[-1]  # only the last transaction is new: an incremental batch
        pairs = [(s, recent if uniform or s % 2 else recent - 1) for s in range(0, 128)]
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + batch_query("es", pairs, horizon)))
    assert "events_slice_tx_idx" in plan, plan
    assert "Seq Scan on events" not in plan, plan


@pytest.mark.parametrize(
    ("writer", "master", "needs_spark"),
    [("delta-rs", "local[*]", False), ("spark", "local[2]", True), ("delta-rs", "spark://cluster:7077", True)],
)
def test_build_extractor_starts_spark_only_for_the_spark_writer_or_a_cluster(
    tmp_path: Path, writer: str, master: str, needs_spark: bool
) -> None:
    settings = Settings(pg_dsn="postgresql://unused/db", warehouse=tmp_path, events_writer=writer, spark_master=master)
    started: list[str] = []

    def spark() -> str:
        started.append("spark")
        return "a session"

    extractor = build_extractor(settings, spark if needs_spark else no_spark)
    assert (extractor.spark == "a session") is needs_spark and len(started) == int(needs_spark)
    assert (extractor.writer, extractor.dsn, extractor.warehouse) == (writer, settings.pg_dsn, tmp_path)
    assert extractor.jdbc_min_rows == (0 if master.startswith("local") else 500_000)
    chosen = build_extractor(replace(settings, jdbc_min_rows=1000), lambda: "a session")
    assert (chosen.jdbc_min_rows, chosen.spark) == (1000, "a session"), "ES_PIPELINE_JDBC_MIN_ROWS wins over the master"


def test_wide_events_are_cut_by_bytes_as_well_as_rows(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    """Events of ~4 KB under a 1 MiB cap: batches of a few hundred, not `batch_events`; still exactly once."""
    with psycopg.connect(dsn) as conn:
        for t in range(30):
            with conn.transaction():
                conn.execute(
                    "INSERT INTO es.events (stream_id, stream_type, version, event_type, payload) "
                    "SELECT 'wide-' || g, 'doc', %s, 'Written', jsonb_build_object('text', repeat(md5(g::text || %s), 128)) "
                    "FROM generate_series(1, 100) g", (t + 1, t),
                )
    ex = Extractor(dsn.extractor, None, warehouse, batch_bytes=1 << 20)
    with psycopg.connect(dsn) as conn:
        target = ex.batch_target(reader.average_row_bytes(conn, "es", [(s, 0) for s in range(1024)], 2**62))
    assert 100 <= target <= 400, f"~4 KB rows under 1 MiB: {target}"
    result = ex.run(SliceRange(0, 1023))
    assert result.batches >= 3000 // (2 * target)
    assert max(result.batch_rows) <= 1.5 * target + 100, "a cut falls between transactions of 100 events"
    assert assert_exactly_once(spark, warehouse, dsn) == 3000


def _append_wide(dsn: str, first: int, count: int) -> None:
    """`count` events of ~4 KB, one transaction each, versions `first`.. of stream 'wide'."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for v in range(first, first + count):
            conn.execute(
                "INSERT INTO es.events (stream_id, stream_type, version, event_type, payload) "
                "VALUES ('wide', 'doc', %s, 'Written', jsonb_build_object('text', repeat(md5(%s::text), 128)))", (v, v))


def test_a_backlog_of_at_most_256_events_is_one_batch_and_a_larger_one_is_cut_by_width(
    dsn: StoreDsn, warehouse: Path
) -> None:
    """A tailing pass's small backlog is one batch without sampling its width (UNSAMPLED_BACKLOG): 200 rows of
    ~4 KB pass a 64 KiB guide in one batch. Past 256 the width is sampled and the same rows are cut into
    batches of about 16. Exactly once either way."""
    assert UNSAMPLED_BACKLOG == 256
    ex = Extractor(dsn.extractor, None, warehouse, batch_bytes=64 << 10)
    _append_wide(dsn, 1, 200)
    small = ex.run(SliceRange(0, 1023))
    assert (small.batches, small.batch_rows) == (1, [200])
    _append_wide(dsn, 201, 300)
    large = ex.run(SliceRange(0, 1023))
    assert large.batches >= 300 // 32 and max(large.batch_rows) <= 1.5 * 16 + 1, large.batch_rows
    assert assert_exactly_once_by_key(warehouse, dsn) == 500, "every event of the store once, with its payload"


BIG_EVENTS = 400  # of 1 MiB each, in one transaction


def _extract_in_child(dsn: str, warehouse: Path) -> tuple[int, str]:
    """`es-pipeline extract` in a process of its own: (its peak RSS in MiB, its output)."""
    code = (
        "import resource, sys\n"
        "from es_pipeline.cli import main\n"
        "code = main(['extract'])\n"
        "print('maxrss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "ES_PIPELINE_PG_DSN": dsn, "ES_PIPELINE_WAREHOUSE": str(warehouse),
           "ES_PIPELINE_SLICE_RANGES": "1", "ES_PIPELINE_BATCH_BYTES": "64MB"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rss_kib = int(done.stdout.rsplit("maxrss_kib", 1)[1].split()[0])
    return rss_kib // 1024, done.stdout


@pytest.mark.one_major  # the client streams: no server major changes that; 400 MiB written costs a minute per major
def test_one_transaction_larger_than_the_batch_cap_streams_through_in_bounded_memory(
    dsn: StoreDsn, warehouse: Path
) -> None:
    """400 MiB of payload in one transaction, a 64 MB batch cap: it cannot be split, so it goes as one
    batch, streamed. The run's peak memory stays far below the batch: before streaming, delta-rs alone
    held about three times the batch (docs/decisions.md, "No poison batch")."""
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO es.events (stream_id, stream_type, version, event_type, payload) "
                     "VALUES ('small-1', 'doc', 1, 'Written', '{}')")
        conn.commit()
    baseline_mib, _ = _extract_in_child(dsn.extractor, warehouse)  # the same process with a one-event batch
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO es.events (stream_id, stream_type, version, event_type, payload) "
            "SELECT 'big-' || g, 'blob', 1, 'Blob', jsonb_build_object('blob', repeat(md5(g::text), 32768)) "
            "FROM generate_series(1, %s) g", (BIG_EVENTS,),
        )
        conn.commit()
        payload_mib = conn.execute("SELECT sum(octet_length(payload::text)) FROM es.events").fetchone()[0] / 2**20
        expected = dict(conn.execute("SELECT stream_id, md5(payload::text) FROM es.events").fetchall())
    peak_mib, out = _extract_in_child(dsn.extractor, warehouse)
    print(f"{payload_mib:.0f} MiB in one transaction: peak RSS {peak_mib} MiB; one small event: {baseline_mib} MiB")
    assert "400 events in 1 batches" in out, out
    assert payload_mib > 390
    assert peak_mib - baseline_mib < payload_mib / 2, (
        f"extracting {payload_mib:.0f} MiB took {peak_mib} MiB at peak, {baseline_mib} MiB for one small event"
    )
    lake = DeltaTable(tables.table_path(warehouse, "events")).to_pyarrow_dataset()
    seen: dict[str, str] = {}
    for batch in lake.to_batches(columns=["stream_id", "payload"], batch_size=16):
        for stream_id, payload in zip(batch["stream_id"].to_pylist(), batch["payload"].to_pylist(), strict=True):
            assert stream_id not in seen, f"{stream_id} twice in the lake"
            seen[stream_id] = hashlib.md5(payload.encode()).hexdigest()
    assert seen == expected
