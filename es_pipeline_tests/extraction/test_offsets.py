"""Offsets under what operators do: a reset never duplicates a live lake; a restored store or lake is refused."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable
from psycopg.conninfo import conninfo_to_dict

from es_pipeline.cli import main
from es_pipeline.dev.workload import bulk_load, run_workload
from es_pipeline.errors import LakeStoreDiverged, ReadOnlyStore
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.offsets import OffsetSession
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.lake.delta import tables
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.lakecheck import assert_exactly_once, assert_exactly_once_by_key, extract_all
from es_pipeline_tests.support.roles import StoreDsn
from es_pipeline_tests.support.store import watermark_count


def test_reset_over_a_lake_that_holds_events_is_refused_until_it_is_removed(
    dsn: StoreDsn, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_workload(EventStore(dsn), streams=30, events=200, writers=2, rollback_rate=0, max_commit_delay=0)
    extract_all(dsn.extractor, spark, warehouse)
    monkeypatch.setenv("ES_PIPELINE_PG_DSN", dsn.extractor)
    monkeypatch.setenv("ES_PIPELINE_WAREHOUSE", str(warehouse))

    assert main(["offsets", "reset"]) == 2
    err = capsys.readouterr().err
    assert "still holds events" in err and str(warehouse / "events") in err and "Nothing was forgotten" in err
    assert watermark_count(dsn) == 1024, "a refused reset forgets nothing"

    shutil.rmtree(warehouse / "events")
    assert main(["offsets", "reset"]) == 0
    assert watermark_count(dsn) == 0
    extract_all(dsn.extractor, spark, warehouse)
    assert assert_exactly_once(spark, warehouse, dsn) == 200


def _copy_database(admin_dsn: str, dsn: str, name: str) -> StoreDsn:
    """A copy of the test database as it is now: PostgreSQL as a point-in-time restore would bring it back."""
    source = conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{source}"')
    return dsn.of_database(name)


def _append(dsn: str, events: int, seed: int) -> None:
    run_workload(EventStore(dsn), streams=30, events=events, writers=2, rollback_rate=0, max_commit_delay=0, seed=seed)


def test_postgres_restored_behind_the_lake_is_refused_not_skipped_or_repeated(
    dsn: StoreDsn, pg_server: str, spark: Any, warehouse: Path
) -> None:
    _append(dsn, 100, 1)
    Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))
    behind = _copy_database(pg_server, dsn, conninfo_to_dict(dsn)["dbname"] + "_pitr")
    try:
        _append(dsn, 100, 2)
        Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))  # the lake moves on; the copy does not know
        before = tables.table_version(spark, str(warehouse / "events"))
        with pytest.raises(LakeStoreDiverged, match="PostgreSQL is behind the lake"):
            Extractor(behind.extractor, spark, warehouse).run(SliceRange(0, 1023))
        assert tables.table_version(spark, str(warehouse / "events")) == before, "nothing was written"
        assert assert_exactly_once(spark, warehouse, dsn) == 200
    finally:
        with psycopg.connect(pg_server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{conninfo_to_dict(behind)["dbname"]}" WITH (FORCE)')


def test_a_lake_restored_from_an_older_copy_is_refused(dsn: StoreDsn, spark: Any, warehouse: Path, tmp_path: Path) -> None:
    _append(dsn, 100, 1)
    Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))
    old = tmp_path / "old_copy"
    shutil.copytree(warehouse, old)  # same Delta table id: the sink binding alone cannot tell
    _append(dsn, 100, 2)
    Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))
    with pytest.raises(LakeStoreDiverged, match="the lake is behind PostgreSQL"):
        Extractor(dsn.extractor, spark, old).run(SliceRange(0, 1023))


def test_a_store_upgraded_from_before_the_record_adopts_the_lake_once(dsn: StoreDsn, spark: Any, warehouse: Path) -> None:
    _append(dsn, 100, 1)
    Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM es_pipeline.lake_commits")  # as an older release left it
    _append(dsn, 100, 2)
    Extractor(dsn.extractor, spark, warehouse).run(SliceRange(0, 1023))
    assert assert_exactly_once(spark, warehouse, dsn) == 200
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM es_pipeline.lake_commits").fetchone() == (1,)


def test_offset_sessions_commit_synchronously_whatever_the_role_says(dsn: StoreDsn) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET synchronous_commit = off', current_database()); END $$")
    with OffsetSession(dsn.extractor, "events", run_id="t", label="t") as session:
        row = session.conn.execute("SHOW synchronous_commit").fetchone()
    assert row == ("on",)


def test_a_read_only_store_is_refused_before_anything_is_created(dsn: StoreDsn, warehouse: Path) -> None:
    _append(dsn, 20, 1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET default_transaction_read_only = on', "
                     "current_database()); END $$")
    with pytest.raises(ReadOnlyStore, match="read-only") as err:
        Extractor(dsn.extractor, None, warehouse).run(SliceRange(0, 1023))
    assert "\n" not in str(err.value)
    assert not (warehouse / "events").exists(), "no Delta table was created"


def test_a_roles_timeouts_cannot_cut_a_run(dsn: StoreDsn, warehouse: Path) -> None:
    """statement_timeout would kill the batch's read on every replay; idle_in_transaction_session_timeout the
    transaction that holds the slice locks while the batch is read: es_pipeline's sessions turn both off."""
    bulk_load(dsn, events=200_000, streams=2_000)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET statement_timeout = ''100ms''', current_database()); "
                     "EXECUTE format('ALTER DATABASE %I SET idle_in_transaction_session_timeout = ''100ms''', "
                     "current_database()); END $$")
    with psycopg.connect(dsn) as conn, pytest.raises(psycopg.errors.QueryCanceled):
        conn.execute("SELECT pg_sleep(0.3)")  # the timeout is real for the applications' sessions
    result = Extractor(dsn.extractor, None, warehouse).run(SliceRange(0, 1023))
    assert result.rows == 200_000 and result.read_seconds > 0.1
    keys = DeltaTable(str(warehouse / "events")).to_pyarrow_table(columns=["stream_id", "version"])
    assert keys.num_rows == 200_000 and len(set(zip(keys["stream_id"].to_pylist(), keys["version"].to_pylist(),
                                                    strict=True))) == 200_000


def test_a_pass_moves_only_the_slices_it_brought_rows_of_and_loses_or_repeats_nothing(dsn: StoreDsn,
                                                                                        warehouse: Path) -> None:
    """`OffsetSession.commit(moved=...)`: within FULL_ADVANCE_SECONDS, the slices without rows keep their watermark;
    an event that later commits into one of them is extracted once, as the store holds it (decision 0045)."""
    store = EventStore(dsn.writer)
    with psycopg.connect(dsn.extractor) as conn:
        by_slice: dict[int, str] = {}
        for n in range(200):  # three streams in three different slices
            sid = f"moved-{n}"
            row = conn.execute("SELECT es.slice_of(%s)", (sid,)).fetchone()
            assert row is not None
            by_slice.setdefault(int(row[0]), sid)
            if len(by_slice) == 3:
                break
    (a, first), (b, second), (c, third) = sorted(by_slice.items())
    extractor = Extractor(dsn.extractor, None, warehouse)
    everything = SliceRange(0, 1023)
    with extractor.session(everything, "moved-test") as session:
        store.append(first, "cart", [NewEvent("ItemAdded", {"n": 1})], 0)
        one = extractor.run(everything, run_id="moved-test", session=session)  # a session's first commit: all move
        store.append(second, "cart", [NewEvent("ItemAdded", {"n": 2})], 0)
        two = extractor.run(everything, run_id="moved-test", session=session)
        marks = session.watermarks([a, b, c])
        assert marks[b] == two.horizon and marks[a] == marks[c] == one.horizon < two.horizon
        store.append(third, "cart", [NewEvent("ItemAdded", {"n": 3})], 0)
        store.append(first, "cart", [NewEvent("ItemRemoved", {"n": 4})], 1)
        three = extractor.run(everything, run_id="moved-test", session=session)
    assert (one.rows, two.rows, three.rows) == (1, 1, 2)
    assert assert_exactly_once_by_key(warehouse, dsn.extractor) == 4
