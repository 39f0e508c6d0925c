"""One place per slice behind a transaction-pooling PgBouncer, and when a run's locks are lost."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from es_pipeline.errors import SliceLocked, SliceLockLost
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.offsets import Batch
from es_pipeline.extraction.slices import SliceRange, split
from es_pipeline_tests.support.hooks import hold_when_locked
from es_pipeline_tests.support.lakecheck import assert_exactly_once
from es_pipeline_tests.support.pooler import pgbouncer
from es_pipeline_tests.support.roles import StoreDsn
from es_pipeline_tests.support.store import append_workload


def _via(dsn: str, port: int) -> str:
    return make_conninfo(dsn, host="127.0.0.1", port=str(port))


def test_through_a_transaction_pooler_a_slice_is_extracted_in_one_place_and_exactly_once(
    dsn: StoreDsn, spark: Any, warehouse: Path
) -> None:
    server_port = int(conninfo_to_dict(dsn)["port"])
    users = [conninfo_to_dict(d)["user"] for d in (dsn.writer, dsn.extractor)]
    with pgbouncer(server_port, pool_mode="transaction", users=users) as port:
        pooled = _via(dsn.extractor, port)
        append_workload(_via(dsn.writer, port), 300, 1, writers=4)  # writers through the pooler too
        holding, release = threading.Event(), threading.Event()
        hold = hold_when_locked(holding, release)
        first = threading.Thread(target=lambda: Extractor(pooled, None, warehouse, on_step=hold).run(SliceRange(0, 1023)))
        first.start()
        try:
            assert holding.wait(30)
            # Statements of other clients go to any server connection: the locks must still be seen there.
            for _ in range(5):
                with pytest.raises(SliceLocked):
                    Extractor(pooled, None, warehouse).run(SliceRange(0, 511))
        finally:
            release.set()
            first.join(60)
        writing = threading.Thread(target=append_workload, args=(_via(dsn.writer, port), 400, 2, 4))
        writing.start()
        for r in split(4):
            Extractor(pooled, None, warehouse).run(r)
        writing.join()
        for r in split(8):  # and re-sliced
            Extractor(pooled, None, warehouse).run(r)
        assert assert_exactly_once(spark, warehouse, dsn) == 700


def test_a_run_whose_locks_are_lost_commits_nothing_and_its_batch_is_replayed(
    dsn: StoreDsn, spark: Any, warehouse: Path
) -> None:
    append_workload(dsn, 200, 3, writers=4)

    def lose_locks(name: str, batch: Batch | None) -> None:
        if name == "delta_committed":
            with psycopg.connect(dsn, autocommit=True) as conn:  # the lock holder's backend ends
                held = "FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND granted"
                conn.execute(f"SELECT pg_terminate_backend(pid) {held}")
                deadline = time.monotonic() + 10  # the signal is asynchronous: wait for the locks to go
                while conn.execute(f"SELECT count(*) {held}").fetchone() != (0,) and time.monotonic() < deadline:
                    time.sleep(0.05)

    with pytest.raises(SliceLockLost, match="no longer held"):
        Extractor(dsn.extractor, None, warehouse, on_step=lose_locks).run(SliceRange(0, 1023))
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM es_pipeline.offsets WHERE watermark > '0'").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM es_pipeline.pending_batches").fetchone() == (1,)
    result = Extractor(dsn.extractor, None, warehouse).run(SliceRange(0, 1023))
    assert result.replayed_batches == 1
    assert assert_exactly_once(spark, warehouse, dsn) == 200
