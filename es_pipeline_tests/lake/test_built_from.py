"""Every projection knows which `events` table it was built from: the lake rebuilt (by hand: the `events` folder
removed, `offsets reset`, extracted again; or `es-pipeline lake rebuild` as docs/operations.md writes it), in more
commits or in fewer, leaves every projection equal to a fold of the store, never read on from its position in the
old table. And the rebuild refuses what would lose events or race a run, changing nothing.

The expected values come from the store (SQL and the domain's reducers over `es.events`), never from the lake."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from es_pipeline.cli import main
from es_pipeline.dev.workload import run_workload
from es_pipeline.extraction.offsets import OffsetSession
from es_pipeline.lake.kernel.position import FENCE
from es_pipeline.lake.read.behind import Lake
from es_pipeline.lake.typed import event_tables
from es_pipeline.settings import PROJECT_ROOT
from es_pipeline.source import mapping
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.lakecheck import assert_exactly_once_by_key, extract_all
from es_pipeline_tests.support.projections import (
    assert_every_projection_equals_the_store,
    update_every_projection,
)
from es_pipeline_tests.support.roles import StoreDsn
from es_pipeline_tests.support.store import watermark_count

PROJECTIONS = ("stream_state", "stream_catalog", "event_type_daily", "sku_sales", event_tables.NAME)


def _cli_on(monkeypatch: pytest.MonkeyPatch, dsn: StoreDsn, warehouse: Path) -> None:
    """`es-pipeline` commands (`main`) on this store, as its extractor, and this lake."""
    monkeypatch.setenv("ES_PIPELINE_PG_DSN", dsn.extractor)
    monkeypatch.setenv("ES_PIPELINE_WAREHOUSE", str(warehouse))


def _rebuild_events(warehouse: Path, dsn: StoreDsn, n_ranges: int) -> None:
    """The lake's `events` rebuilt the way the refusals say: the folder removed, `offsets reset`, extracted again
    (one commit per range: more or fewer commits than the table before)."""
    shutil.rmtree(warehouse / "events")
    assert main(["offsets", "reset"]) == 0
    extract_all(dsn.extractor, None, warehouse, n_ranges=n_ranges)


@pytest.mark.slow
def test_the_lake_rebuilt_in_more_then_fewer_commits_leaves_every_projection_equal_to_the_store(
    dsn: StoreDsn, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cli_on(monkeypatch, dsn, warehouse)
    store = EventStore(dsn.writer)
    run_workload(store, streams=80, events=1500, writers=3, rollback_rate=0.1, max_commit_delay=0, seed=71)
    extract_all(dsn.extractor, None, warehouse, n_ranges=1)
    update_every_projection(spark, warehouse, dsn)
    assert assert_every_projection_equals_the_store(warehouse, dsn) > 0
    kept = Lake(warehouse)  # as the health exporter keeps it, its tables open between readings
    assert all(v is not None for v in kept.folded().values())
    # What an older es_pipeline left (its position under the unbound app id), to be fenced at the rebuild.
    catalog = DeltaTable(str(warehouse / "stream_catalog"))
    catalog.create_write_transaction([], mode="append", schema=catalog.schema(), commit_properties=CommitProperties(
        app_transactions=[Transaction("es_pipeline.stream_catalog", 1)]))

    # More commits than before: read on from the old position, the new table's later commits were counted again.
    _rebuild_events(warehouse, dsn, n_ranges=8)
    for lake in (Lake(warehouse), kept):
        folded = lake.folded()
        assert all(folded[name] is None for name in PROJECTIONS), folded  # rebuilding, never "up to date"
    update_every_projection(spark, warehouse, dsn)
    # An older release still running finds its position past any `events` version: nothing to fold there.
    assert DeltaTable(str(warehouse / "stream_catalog")).transaction_version("es_pipeline.stream_catalog") == FENCE
    assert_exactly_once_by_key(warehouse, dsn)
    assert_every_projection_equals_the_store(warehouse, dsn)
    for lake in (Lake(warehouse), kept):
        assert all(v is not None and v == lake.events_version() for v in lake.folded().values()), lake.folded()

    # Fewer commits than before, with events the old table never had: read as "nothing new", they were frozen.
    run_workload(store, streams=80, events=400, writers=2, rollback_rate=0, max_commit_delay=0, seed=72)
    _rebuild_events(warehouse, dsn, n_ranges=1)
    update_every_projection(spark, warehouse, dsn)
    assert_every_projection_equals_the_store(warehouse, dsn)

    # And on from the rebuild: an ordinary increment.
    run_workload(store, streams=80, events=200, writers=2, rollback_rate=0, max_commit_delay=0, seed=73)
    extract_all(dsn.extractor, None, warehouse, n_ranges=2)
    update_every_projection(spark, warehouse, dsn)
    assert_every_projection_equals_the_store(warehouse, dsn)


def _runbook_commands() -> list[list[str]]:
    """The commands of docs/operations.md's "Rebuilding the lake", as written there (comments left out)."""
    text = (PROJECT_ROOT / "docs" / "operations.md").read_text()
    section = text[text.index("## Rebuilding the lake"):]
    start = section.index("```bash\n") + len("```bash\n")
    block = section[start:section.index("```", start)]
    return [shlex.split(line.split("#", 1)[0]) for line in block.splitlines() if line.split("#", 1)[0].strip()]


@pytest.mark.slow
def test_the_runbooks_rebuild_commands_as_written_leave_every_projection_equal_to_the_store(
    dsn: StoreDsn, spark: Any, warehouse: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli_on(monkeypatch, dsn, warehouse)
    store = EventStore(dsn.writer)
    run_workload(store, streams=60, events=900, writers=3, rollback_rate=0.1, max_commit_delay=0, seed=81)
    extract_all(dsn.extractor, None, warehouse, n_ranges=2)
    update_every_projection(spark, warehouse, dsn)
    run_workload(store, streams=60, events=300, writers=2, rollback_rate=0, max_commit_delay=0, seed=82)

    commands = _runbook_commands()
    assert commands and all(c[:3] == ["es-pipeline", "lake", "rebuild"] for c in commands), commands
    for command in commands:
        assert main(command[1:]) == 0, command
    out = capsys.readouterr().out
    assert {"events", "stream_state", "stream_catalog", "event_type_daily", "sku_sales", event_tables.NAME} <= \
        set(out.splitlines()), out  # --list
    assert "every one in the store" in out and "forgot 1024 slice watermarks" in out, out
    assert "removed stream_catalog" in out, out
    assert not (warehouse / "events").exists() and not (warehouse / "stream_catalog").exists()
    assert watermark_count(dsn) == 0

    extract_all(dsn.extractor, None, warehouse, n_ranges=4)
    update_every_projection(spark, warehouse, dsn)
    assert assert_exactly_once_by_key(warehouse, dsn) == 1200
    assert_every_projection_equals_the_store(warehouse, dsn)


@pytest.mark.slow  # a store, a lake and three rebuilds: make check's budget keeps it in the slow tier
def test_a_rebuild_that_would_lose_events_or_race_a_run_is_refused_and_changes_nothing(
    dsn: StoreDsn, warehouse: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli_on(monkeypatch, dsn, warehouse)
    run_workload(EventStore(dsn.writer), streams=20, events=200, writers=2, rollback_rate=0, max_commit_delay=0)
    extract_all(dsn.extractor, None, warehouse, n_ranges=1)
    path = str(warehouse / "events")
    # An event the lake holds and the store does not (its commit lost with a failed primary): one row again, one
    # version on.
    row = DeltaTable(path).to_pyarrow_table().slice(0, 1)
    write_deltalake(path, row.set_column(row.schema.get_field_index("version"), "version",
                                         pa.array([row["version"][0].as_py() + 1000], row.schema.field("version").type)),
                    mode="append")
    version, marks = DeltaTable(path).version(), watermark_count(dsn)

    assert main(["lake", "rebuild", "no_such_table"]) == 2
    assert "no table 'no_such_table' to rebuild" in capsys.readouterr().err
    assert main(["lake", "rebuild"]) == 2
    err = capsys.readouterr().err
    assert "refusing to rebuild events" in err and "1 event(s) that the event store does not" in err and \
        "--accept-loss" in err, err
    assert (DeltaTable(path).version(), watermark_count(dsn)) == (version, marks)  # nothing changed

    consumer = mapping.load(None, "es").consumer
    with OffsetSession(dsn.extractor, consumer, run_id="a-run", label="a run") as run:
        run.lock(range(128), "0000-0127")
        assert main(["lake", "rebuild", "--accept-loss"]) == 1
        assert "refused, nothing was changed" in capsys.readouterr().err
    assert (DeltaTable(path).version(), watermark_count(dsn)) == (version, marks)

    assert main(["lake", "rebuild", "--accept-loss"]) == 0
    assert "1 of them not in the store, removed as accepted" in capsys.readouterr().out
    assert not (warehouse / "events").exists() and watermark_count(dsn) == 0
    extract_all(dsn.extractor, None, warehouse, n_ranges=2)
    assert assert_exactly_once_by_key(warehouse, dsn) == 200
