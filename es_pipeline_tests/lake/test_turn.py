"""One update of a lake table at a time: the lock, and the last look before the commit."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest
from deltalake import write_deltalake

from es_pipeline.errors import UpdateOverlapped
from es_pipeline.lake.delta.arrow_append import append_batches
from es_pipeline.lake.kernel.turn import one_at_a_time, turn_if_free

SCHEMA = pa.schema([("k", pa.string()), ("n", pa.int64())])


def _commit(path: str, app_id: str, version: int) -> None:
    rows = pa.RecordBatch.from_pydict({"k": ["a"], "n": [version]}, schema=SCHEMA)
    assert append_batches([rows], SCHEMA, path, app_id=app_id, version=version) == 1


def test_a_commit_by_another_update_is_caught_before_this_one_commits(dsn: str, tmp_path: Path) -> None:
    path = str(tmp_path / "counts")
    write_deltalake(path, SCHEMA.empty_table())
    _commit(path, "es_pipeline.counts", 1)
    with one_at_a_time(dsn, "counts") as turn:
        turn.confirm(path, "es_pipeline.counts", 1)  # nothing happened since: this update may commit
        _commit(path, "es_pipeline.counts", 2)  # a writer that did not take the lock
        with pytest.raises(UpdateOverlapped, match="another update committed meanwhile"):
            turn.confirm(path, "es_pipeline.counts", 1)


def test_a_lost_lock_is_caught_before_the_commit(dsn: str, tmp_path: Path) -> None:
    path = str(tmp_path / "counts")
    write_deltalake(path, SCHEMA.empty_table())
    with one_at_a_time(dsn, "counts") as turn:
        with psycopg.connect(dsn, autocommit=True) as conn:  # the lock's backend ends (a restart, a pooler)
            held = "FROM pg_stat_activity WHERE application_name = 'es_pipeline update counts'"
            conn.execute(f"SELECT pg_terminate_backend(pid) {held}")
            deadline = time.monotonic() + 10
            while conn.execute(f"SELECT count(*) {held}").fetchone() != (0,) and time.monotonic() < deadline:
                time.sleep(0.05)
        with pytest.raises(UpdateOverlapped, match="no longer held"):
            turn.confirm(path, "es_pipeline.counts", None)


def test_without_a_store_the_table_is_still_checked(tmp_path: Path) -> None:
    path = str(tmp_path / "counts")
    write_deltalake(path, SCHEMA.empty_table())
    with one_at_a_time(None, "counts") as turn:
        turn.confirm(path, "es_pipeline.counts", None)
        _commit(path, "es_pipeline.counts", 5)
        with pytest.raises(UpdateOverlapped):
            turn.confirm(path, "es_pipeline.counts", None)


def test_a_turn_taken_only_if_free_is_none_while_another_update_holds_it(dsn: str) -> None:
    """What a tailing run uses for the projections: it never waits behind an automation's update."""
    with one_at_a_time(dsn, "stream_state"):
        with turn_if_free(dsn, "stream_state") as busy, turn_if_free(dsn, "stream_catalog") as free:
            assert busy is None and free is not None
    with turn_if_free(dsn, "stream_state") as turn:
        assert turn is not None
