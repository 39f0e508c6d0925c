"""A pass that reads some batches as Arrow and others by Spark's executors over JDBC (issue 58): each batch moves
the watermarks of its own slices, so no later pass reads an event again; a lake an older release left behind is
told apart from a store behind its lake, and moved up, or explained.

The store is written so that one pass holds both kinds: three small transactions over carts of a few slices, then two
large ones over carts of other slices. With batches of 1,000 events, an interval holding a large one and anything
else passes 1.5 times that and is halved, so each large one is a batch of its own, read by JDBC (`jdbc_min_rows`
lies between the sizes), after Arrow batches of small ones: a JDBC batch brings slices no earlier batch did."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from es_pipeline.cli import main
from es_pipeline.errors import WatermarksLeftBehind
from es_pipeline.extraction.extractor import Extractor, ExtractResult
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.extraction.tail import tail
from es_pipeline_tests.support.lakecheck import assert_exactly_once_by_key
from es_pipeline_tests.support.projections import (
    assert_every_projection_equals_the_store,
    update_every_projection,
)
from es_pipeline_tests.support.roles import StoreDsn

EVERYTHING = SliceRange(0, 1023)
SMALL, LARGE = 300, 1400  # events per transaction (module docstring)
JDBC_MIN_ROWS = 1000
BACKLOG = 3 * SMALL + 2 * LARGE


def _append_carts(dsn: str, prefix: str, sizes: list[int]) -> None:
    """One transaction per size, each over carts of its own (`{prefix}-{n}-{i}`, 20 of them), ItemAdded events."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for n, size in enumerate(sizes):
            with conn.transaction():
                conn.execute(
                    "INSERT INTO es.events (stream_id, stream_type, version, event_type, payload, metadata) "
                    "SELECT %(p)s || '-' || %(n)s || '-' || (i %% 20), 'cart', i / 20 + 1, 'ItemAdded', "
                    "jsonb_build_object('sku', 'sku-' || (i %% 7), 'qty', 1 + i %% 3), '{}'::jsonb "
                    "FROM generate_series(0, %(size)s - 1) AS i",
                    {"p": prefix, "n": n, "size": size})


def _mixed_backlog(dsn: str, prefix: str) -> None:
    _append_carts(dsn, prefix, [SMALL, SMALL, SMALL, LARGE, LARGE])


def assert_watermarks_above_the_lake(dsn: str, warehouse: Path) -> None:
    """The property every commit keeps: each slice's watermark lies above every event the lake holds of it, so the
    next pass reads none of them again."""
    lake = DeltaTable(str(warehouse / "events")).to_pyarrow_table(columns=["slice", "tx_id"])
    tops = lake.group_by("slice").aggregate([("tx_id", "max")])
    with psycopg.connect(dsn) as conn:
        marks = dict(conn.execute("SELECT slice, watermark::text::bigint FROM es_pipeline.offsets "
                                  "WHERE consumer = 'events'").fetchall())
    behind = {s: (marks.get(s, 0), top) for s, top in zip(tops["slice"].to_pylist(), tops["tx_id_max"].to_pylist(),
                                                         strict=True) if marks.get(s, 0) <= top}
    assert not behind, f"{len(behind)} slices' watermarks at or below events the lake holds, e.g. {list(behind.items())[:3]}"


def test_a_mixed_pass_of_es_pipeline_extract_moves_every_slice_it_read(
    dsn: StoreDsn, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in {"ES_PIPELINE_PG_DSN": dsn.extractor, "ES_PIPELINE_WAREHOUSE": str(warehouse),
                        "ES_PIPELINE_SLICE_RANGES": "1", "ES_PIPELINE_BATCH_EVENTS": "1000",
                        "ES_PIPELINE_JDBC_MIN_ROWS": str(JDBC_MIN_ROWS), "ES_PIPELINE_SPARK_MASTER": "local[2]"}.items():
        monkeypatch.setenv(name, value)
    _mixed_backlog(dsn, "first")
    assert main(["extract"]) == 0
    out = capsys.readouterr().out
    assert "(2 read by Spark's executors over JDBC)" in out, f"the pass mixes both reads: {out}"
    assert_watermarks_above_the_lake(dsn, warehouse)

    _mixed_backlog(dsn, "second")
    assert main(["extract"]) == 0, "the next pass finds the lake below its watermarks"
    assert_watermarks_above_the_lake(dsn, warehouse)
    assert assert_exactly_once_by_key(warehouse, dsn) == 2 * BACKLOG


def test_a_tailing_run_of_mixed_passes_writes_every_event_once_and_the_projections_equal_the_store(
    dsn: StoreDsn, spark: Any, warehouse: Path,
) -> None:
    """A tailing run checks the lake only when its session opens: its later passes rely on the watermarks alone."""
    extractor = Extractor(dsn.extractor, spark, warehouse, batch_events=1000, jdbc_min_rows=JDBC_MIN_ROWS)
    total = 2 * BACKLOG
    _mixed_backlog(dsn, "first")
    passes: list[ExtractResult] = []
    done = threading.Event()

    def on_pass(result: ExtractResult) -> None:
        passes.append(result)
        assert_watermarks_above_the_lake(dsn, warehouse)
        if sum(p.rows for p in passes) >= total:
            done.set()

    with extractor.session(EVERYTHING, "tail-mixed") as session:
        on_pass(extractor.run(EVERYTHING, run_id="tail-mixed", session=session))  # the run's first pass
        _mixed_backlog(dsn, "second")  # committed while the run holds its session: its next passes take them
        tail(extractor, EVERYTHING, run_id="tail-mixed", seconds=30, on_pass=on_pass, poll_seconds=1,
             session=session, stop=done)
    first = next(p for p in passes if p.rows)
    assert 0 < first.jdbc_batches < first.batches, "the first pass read both ways"
    assert sum(p.rows for p in passes) == total
    assert assert_exactly_once_by_key(warehouse, dsn) == total
    update_every_projection(spark, warehouse, dsn)
    assert assert_every_projection_equals_the_store(warehouse, dsn) == total


def _set_back(dsn: str, slices: list[int], to: int) -> None:
    """What es_pipeline 0.1.0 left after a mixed pass: these slices' watermarks at `to`, below rows the lake holds
    in batches PostgreSQL recorded as committed."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE es_pipeline.offsets SET watermark = %s::text::xid8 WHERE consumer = 'events' "
                     "AND slice = ANY(%s)", (str(to), slices))


def _slices_of(warehouse: Path, prefix: str) -> tuple[list[int], int]:
    """The slices of the carts named `prefix…`, and the lowest tx_id of theirs in the lake."""
    lake = DeltaTable(str(warehouse / "events")).to_pyarrow_table(columns=["stream_id", "slice", "tx_id"])
    rows = lake.filter(pc.starts_with(lake["stream_id"], prefix))
    return sorted(set(rows["slice"].to_pylist())), int(pc.min(rows["tx_id"]).as_py())


def test_watermarks_an_older_release_left_behind_are_moved_up_where_the_lake_holds_each_event_once(
    dsn: StoreDsn, warehouse: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    extractor = Extractor(dsn.extractor, None, warehouse, progress=print)
    _append_carts(dsn, "early", [SMALL])
    _append_carts(dsn, "late", [SMALL, SMALL])
    extractor.run(EVERYTHING)
    slices, first_late = _slices_of(warehouse, "late-")
    _set_back(dsn, slices, first_late)  # the lake holds 400 events above these watermarks, each once

    _append_carts(dsn, "after", [SMALL])
    result = extractor.run(EVERYTHING)
    assert result.repaired_slices == len(slices) and result.rows == SMALL, "moved up, nothing read again"
    assert "moved up past them" in capsys.readouterr().out
    assert_watermarks_above_the_lake(dsn, warehouse)
    assert assert_exactly_once_by_key(warehouse, dsn) == 4 * SMALL


def test_watermarks_left_behind_and_read_again_are_explained_not_taken_for_a_store_behind_its_lake(
    dsn: StoreDsn, warehouse: Path,
) -> None:
    """The tailing run of an older release read them again in its next pass: the lake holds them twice."""
    extractor = Extractor(dsn.extractor, None, warehouse)
    _append_carts(dsn, "early", [SMALL])
    _append_carts(dsn, "late", [SMALL])
    with extractor.session(EVERYTHING, "old-tail") as session:
        extractor.run(EVERYTHING, session=session)
        slices, first_late = _slices_of(warehouse, "late-")
        _set_back(dsn, slices, first_late)
        _append_carts(dsn, "after", [SMALL])
        extractor.run(EVERYTHING, session=session)  # its pass reads the late carts again, as 0.1.0's did
        _set_back(dsn, slices, first_late)  # and that pass, mixed too, left them behind again
    with pytest.raises(WatermarksLeftBehind, match=r"es-pipeline lake rebuild events") as refused:
        extractor.run(EVERYTHING)
    assert refused.value.twice == SMALL and "\n" not in str(refused.value)
    assert "PostgreSQL is not behind the lake" in str(refused.value)
