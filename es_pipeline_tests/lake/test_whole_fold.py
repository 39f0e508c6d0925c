"""`stream_state`'s first build without a JVM (lake/state/whole_fold.py): forked folds that equal the store and Spark."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.dev.workload import run_workload
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.lake.delta import pieces, tables
from es_pipeline.lake.kernel import engine
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state import forked, stream_state
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.lake.test_stream_state import full_replay, lake_state
from es_pipeline_tests.support.hooks import no_spark
from es_pipeline_tests.support.lakecheck import extract_all, extract_while
from es_pipeline_tests.support.roles import StoreDsn

_COMPARED = ("tenant", "stream_id", "stream_type", "version", "state", "last_event_at", "revision", "parked", "skipped")


def _rows(path: Path) -> list[tuple[Any, ...]]:
    table = DeltaTable(str(path)).to_pyarrow_table(columns=list(_COMPARED))
    return sorted(zip(*(table[c].to_pylist() for c in _COMPARED), strict=True))


def test_the_forked_first_build_equals_the_store_and_spark_and_increments_go_on_from_it(
    dsn: StoreDsn, spark: Any, warehouse: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 writers (out-of-order commits, rollbacks) while extraction runs; then the first build, forked over the
    cores, equals a replay of the store event by event and Spark's first build of the same lake row by row
    (state, times, parked versions, Delta txn version); and both engines' increments go on from it."""
    monkeypatch.setattr(forked, "ONE_PROCESS_ROWS", 0)  # fork even for a few thousand events
    store = EventStore(dsn)
    writers = threading.Thread(target=run_workload, args=(store,), kwargs=dict(
        streams=300, events=4000, writers=8, rollback_rate=0.15, max_commit_delay=0.05, seed=31))
    writers.start()
    extract_while(Extractor(dsn.extractor, spark, warehouse), writers.is_alive)
    writers.join()
    extract_all(dsn.extractor, spark, warehouse)

    spark_lake, pieces_lake = tmp_path / "spark-lake", tmp_path / "pieces-lake"
    shutil.copytree(warehouse / "events", spark_lake / "events")
    shutil.copytree(warehouse / "events", pieces_lake / "events")
    expected = {k: (v, json.loads(json.dumps(s))) for k, (v, s) in full_replay(dsn).items()}
    built = update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)
    assert (built.previous_events_version, built.events_folded, built.figures["streams_updated"]) == (-1, 4000, len(expected))
    by_spark = update_stream_state(Engine(spark=spark, small_increments=False), spark_lake, domain=SHOP)
    assert (by_spark.events_folded, by_spark.figures["streams_updated"]) == (4000, len(expected))
    assert _rows(warehouse / "stream_state") == _rows(spark_lake / "stream_state")
    # In pieces (lake/delta/pieces.py): some 7 pieces by slice span, read back from disk, a piece per worker.
    monkeypatch.setattr(pieces, "PIECE_BYTES", tables.files_bytes(DeltaTable(str(warehouse / "events"))) // 7 + 1)
    in_pieces = update_stream_state(Engine(spark=no_spark), pieces_lake, domain=SHOP)
    assert (in_pieces.events_folded, in_pieces.figures["streams_updated"]) == (4000, len(expected))
    assert _rows(pieces_lake / "stream_state") == _rows(warehouse / "stream_state")
    app = stream_state.app_id(tables.table_id(str(warehouse / "events")))  # the copy of `events` is the same table
    assert tables.transaction_version(str(warehouse / "stream_state"), app) == \
        tables.transaction_version(str(spark_lake / "stream_state"), app) is not None
    assert {k: (v, s) for k, (v, s, _) in lake_state(spark, warehouse).items()} == expected

    run_workload(store, streams=300, events=600, writers=4, rollback_rate=0.1, max_commit_delay=0, seed=32)
    extract_all(dsn.extractor, spark, warehouse)
    # the small increment, from the build
    assert update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP).events_folded == 600
    run_workload(store, streams=300, events=300, writers=4, rollback_rate=0.1, max_commit_delay=0, seed=33)
    extract_all(dsn.extractor, spark, warehouse)
    assert update_stream_state(Engine(spark=spark, small_increments=False), warehouse, domain=SHOP).events_folded == 300  # and Spark's
    expected = {k: (v, json.loads(json.dumps(s))) for k, (v, s) in full_replay(dsn).items()}
    assert {k: (v, s) for k, (v, s, _) in lake_state(spark, warehouse).items()} == expected


def test_a_lake_past_the_bound_is_left_to_spark(dsn: StoreDsn, spark: Any, warehouse: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    run_workload(EventStore(dsn), streams=20, events=200, writers=2, rollback_rate=0, max_commit_delay=0, seed=34)
    extract_all(dsn.extractor, spark, warehouse)
    monkeypatch.setattr(engine, "SPARK_BYTES", 1)
    with pytest.raises(AssertionError, match="asked for a Spark session"):
        update_stream_state(Engine(spark=no_spark), warehouse, domain=SHOP)
    assert update_stream_state(Engine(spark=spark), warehouse, domain=SHOP).events_folded == 200
    newest = DeltaTable(str(warehouse / "stream_state")).history(1)[0]
    assert "delta-rs" not in str(newest.get("clientVersion", "")), "Spark committed the first build"


def _double(i: int) -> int:
    return 2 * i


def test_forked_workers_leave_the_parents_spark_connections_whole(spark: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A fork drops the Py4J connections of the threads it does not copy; closing them must not shut down the
    parent's (which the JVM would then reset under the parent's threads: seen in `make bench` as Py4J's
    "Connection reset by peer")."""
    from concurrent.futures import ThreadPoolExecutor

    caplog.set_level("INFO", logger="py4j")
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda i: spark.range(i).count(), [1, 2, 3, 4])) == [1, 2, 3, 4]
        assert forked.run(None, _double, [1, 2]) == [2, 4]
        assert list(pool.map(lambda i: spark.range(i).count(), [1, 2, 3, 4])) == [1, 2, 3, 4]
    said = [r.getMessage() for r in caplog.records if r.name.startswith("py4j")]
    assert not [m for m in said if "Error while sending" in m or "reset" in m.lower()], said
