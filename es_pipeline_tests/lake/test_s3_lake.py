"""The lake on object storage: a real S3 server (s3proxy, its filesystem store), delta-rs committing with
put-if-absent. Concurrent writers lose no commit, and extraction into an s3:// warehouse brings every
committed event once, checked event by event against the store."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.dev.s3proxy import S3Server
from es_pipeline.dev.workload import run_workload
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import split
from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog
from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.arrow_append import append_batches
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.maintenance import maintain
from es_pipeline.lake.read import metastore
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.settings import Settings, local_pg_dsn
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.lakecheck import (
    assert_events_checks_pass,
    assert_exactly_once,
    extract_all,
    source_events,
)
from es_pipeline_tests.support.roles import StoreDsn

PROCESSES, COMMITS_EACH, ROWS_EACH = 8, 6, 50
SCHEMA = pa.schema([("writer", pa.int32()), ("commit", pa.int32()), ("row", pa.int32())])


def _append_commits(uri: str, writer: int, start: multiprocessing.synchronize.Event) -> None:
    """One writer process: COMMITS_EACH appends, each a Delta transaction of its own app id."""
    start.wait(60)
    for commit in range(COMMITS_EACH):
        rows = pa.record_batch([pa.array([writer] * ROWS_EACH, pa.int32()), pa.array([commit] * ROWS_EACH, pa.int32()),
                                pa.array(range(ROWS_EACH), pa.int32())], schema=SCHEMA)
        assert append_batches([rows], SCHEMA, uri, app_id=f"writer-{writer}", version=commit + 1) == ROWS_EACH


def test_eight_processes_appending_to_one_table_on_s3_lose_no_commit(s3: S3Server) -> None:
    uri = f"{s3.bucket('lake')}/concurrent/table"
    tables.ensure_table_arrow(uri, SCHEMA)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_append_commits, args=(uri, w, start)) for w in range(PROCESSES)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0] * PROCESSES
    table = DeltaTable(uri)
    assert table.version() == PROCESSES * COMMITS_EACH, "one version per commit, after the creation (0)"
    writes = [h for h in table.history() if h["operation"] == "WRITE"]
    assert len(writes) == PROCESSES * COMMITS_EACH
    rows = table.to_pyarrow_table()
    counts = Counter(zip(rows["writer"].to_pylist(), rows["commit"].to_pylist(), strict=True))
    assert counts == {(w, c): ROWS_EACH for w in range(PROCESSES) for c in range(COMMITS_EACH)}, "every row, once"
    for w in range(PROCESSES):
        assert table.transaction_version(f"writer-{w}") == COMMITS_EACH


def test_extraction_into_an_s3_warehouse_brings_every_event_once(dsn: StoreDsn, s3: S3Server) -> None:
    warehouse = f"{s3.bucket('lake')}/warehouse-{os.getpid()}"
    assert Settings.from_env({"ES_PIPELINE_WAREHOUSE": warehouse + "/"}).warehouse == warehouse
    stop = threading.Event()
    writing = threading.Thread(target=run_workload, args=(EventStore(dsn.writer),), kwargs=dict(
        streams=60, events=None, writers=4, rollback_rate=0.1, max_commit_delay=0.02, rate=400.0, stop=stop))
    writing.start()
    try:
        for ranges in (4, 8, 4):  # re-sliced between passes, ranges of a pass extracted at once
            passes = [threading.Thread(target=Extractor(dsn.extractor, None, warehouse).run, args=(r,))
                      for r in split(ranges)]
            for t in passes:
                t.start()
            for t in passes:
                t.join(120)
    finally:
        stop.set()
        writing.join(60)
    for r in split(2):  # everything committed is below the horizon now
        Extractor(dsn.extractor, None, warehouse).run(r)
    path = tables.table_path(warehouse, "events")
    assert path.startswith("s3://") and tables.is_delta_table(path) and not Path(path).exists()
    lake = DeltaTable(path).to_pyarrow_table(columns=["stream_id", "version", "payload"])
    keys = list(zip(lake["stream_id"].to_pylist(), lake["version"].to_pylist(), strict=True))
    assert len(keys) == len(set(keys)), "no event twice"
    expected = source_events(dsn)
    assert len(expected) > 100
    assert dict(zip(keys, lake["payload"].to_pylist(), strict=True)) == expected, "every committed event, same payload"
    assert tables.table_id(path) == DeltaTable(path).metadata().id

    # An analyst's query, `es-pipeline sql` in its own process: by DuckDB (the default), then by Spark (S3A on the
    # same store and keys) through the catalog, which registers the S3 table by name (the local server's
    # `metastore` database, made on first use).
    catalog = local_pg_dsn(Settings.from_env().local_pg_port, "metastore")
    for engine, query in (("duckdb", "SELECT count(*) AS n, count(DISTINCT (stream_id, version)) AS k FROM events"),
                          ("spark", "SELECT count(*) AS n, count(DISTINCT stream_id, version) AS k FROM events")):
        done = subprocess.run([str(Path(sys.executable).parent / "es-pipeline"), "sql", query, "--engine", engine,
                               "--format", "csv"], capture_output=True, text=True, timeout=600, check=False,
                              env={**os.environ, "ES_PIPELINE_WAREHOUSE": warehouse, "ES_PIPELINE_SPARK_MASTER": "local[2]",
                                   "ES_PIPELINE_METASTORE_DSN": catalog})
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.splitlines() == ["n,k", f"{len(expected)},{len(expected)}"], (engine, done.stdout)
    named = metastore.registered(metastore.Metastore(catalog))
    assert metastore.location_key(named["events"]) == path


@pytest.mark.parametrize("where", ["s3", "local"])
def test_creators_racing_for_a_new_table_make_one_table(s3: S3Server, tmp_path: Path, where: str) -> None:
    """The first runs of every range create `events` at once: one CREATE must win, and the table keep its id
    (a creator retried after losing would commit a second CREATE, with a new id)."""
    uri = f"{s3.bucket('lake')}/race-{os.getpid()}/t" if where == "s3" else str(tmp_path / "t")
    start = threading.Barrier(8)

    def create() -> None:
        start.wait(30)
        tables.ensure_table_arrow(uri, SCHEMA)

    creators = [threading.Thread(target=create) for _ in range(8)]
    for t in creators:
        t.start()
    for t in creators:
        t.join(60)
    history = DeltaTable(uri).history()
    assert [h["operation"] for h in history] == ["CREATE TABLE"]
    assert tables.table_id(uri) == DeltaTable(uri).metadata().id


def test_compaction_during_extraction_on_s3_loses_no_commit(dsn: StoreDsn, s3: S3Server) -> None:
    """`lake_maintenance` (delta-rs compaction and vacuum of `events` on S3) while ranges are extracted and
    writers append: every commit is a version of its own, and the lake equals the store, event by event."""
    warehouse = f"{s3.bucket('lake')}/maintained-{os.getpid()}"
    path = tables.table_path(warehouse, "events")
    stop = threading.Event()
    writing = threading.Thread(target=run_workload, args=(EventStore(dsn.writer),), kwargs=dict(
        streams=40, events=None, writers=2, rollback_rate=0.1, max_commit_delay=0.02, rate=300.0, stop=stop))
    committed: list[int] = []  # rows of each batch the runs committed

    def extract_for_a_while() -> None:
        for ranges in (4, 2, 4, 8, 4):
            for r in split(ranges):
                committed.extend(n for n in Extractor(dsn.extractor, None, warehouse).run(r).batch_rows if n > 0)

    writing.start()
    extracting = threading.Thread(target=extract_for_a_while)
    extracting.start()
    compactions = 0
    while extracting.is_alive():
        if tables.is_delta_table(path):
            compactions += maintain(warehouse)["events"]["files_added"] > 0
        extracting.join(1.5)
    stop.set()
    writing.join(60)
    for r in split(1):
        committed.extend(n for n in Extractor(dsn.extractor, None, warehouse).run(r).batch_rows if n > 0)
    during = compactions
    compactions += maintain(warehouse)["events"]["files_added"] > 0
    table = DeltaTable(path)
    history = table.history()
    assert sorted(h["version"] for h in history) == list(range(table.version() + 1)), "no version lost or reused"
    operations = Counter(h["operation"] for h in history)
    assert operations["WRITE"] == len(committed) and operations["OPTIMIZE"] == compactions
    assert during >= 2, f"compactions while runs committed: {during}"
    lake = table.to_pyarrow_table(columns=["stream_id", "version", "payload"])
    keys = list(zip(lake["stream_id"].to_pylist(), lake["version"].to_pylist(), strict=True))
    assert len(keys) == len(set(keys)) == sum(committed)
    assert dict(zip(keys, lake["payload"].to_pylist(), strict=True)) == source_events(dsn)


def test_spark_written_batches_race_delta_rs_commits_on_s3_and_lose_none(
    dsn: StoreDsn, spark: Any, s3: S3Server
) -> None:
    """Where Spark does the work (the executors' JDBC reads, the Spark writer) it only writes Parquet files;
    delta-rs commits them. So Spark-read ranges, delta-rs-read ranges and compaction commit to `events` on S3
    at once, writers appending meanwhile, and every commit is a version of its own, every event once."""
    warehouse = f"{s3.bucket('lake')}/spark-files-{os.getpid()}"
    path = tables.table_path(warehouse, "events")
    stop = threading.Event()
    writing = threading.Thread(target=run_workload, args=(EventStore(dsn.writer),), kwargs=dict(
        streams=40, events=None, writers=2, rollback_rate=0.1, max_commit_delay=0.02, rate=200.0, stop=stop))
    committed: list[int] = []
    errors: list[BaseException] = []
    ranges = split(4)

    def extract(r: Any, session: Any = None, **kw: Any) -> None:
        try:
            for _ in range(4):
                result = Extractor(dsn.extractor, session, warehouse, **kw).run(r)
                committed.extend(n for n in result.batch_rows if n > 0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    writing.start()
    runs = [threading.Thread(target=extract, args=(ranges[0],), kwargs={"session": spark, "jdbc_min_rows": 1}),
            threading.Thread(target=extract, args=(ranges[1],), kwargs={"session": spark, "writer": "spark"}),
            threading.Thread(target=extract, args=(ranges[2],)), threading.Thread(target=extract, args=(ranges[3],))]
    for t in runs:
        t.start()
    compactions = 0
    while any(t.is_alive() for t in runs):
        if tables.is_delta_table(path):
            compactions += maintain(warehouse)["events"]["files_added"] > 0
        runs[0].join(1.0)
    stop.set()
    writing.join(60)
    assert not errors, errors
    for r in split(1):
        committed.extend(n for n in Extractor(dsn.extractor, spark, warehouse, jdbc_min_rows=1).run(r).batch_rows if n)
    table = DeltaTable(path)
    history = table.history()
    assert sorted(h["version"] for h in history) == list(range(table.version() + 1)), "no version lost or reused"
    assert all("delta-rs" in str(h.get("clientVersion", "")) for h in history), "delta-rs made every commit"
    assert Counter(h["operation"] for h in history)["WRITE"] == len(committed)
    lake = table.to_pyarrow_table(columns=["stream_id", "version", "payload"])
    keys = list(zip(lake["stream_id"].to_pylist(), lake["version"].to_pylist(), strict=True))
    assert len(keys) == len(set(keys)) == sum(committed)
    assert dict(zip(keys, lake["payload"].to_pylist(), strict=True)) == source_events(dsn)
    assert assert_exactly_once(spark, warehouse, dsn) == len(keys), "Spark reads the same lake"
    fs, root = tables.filesystem(path)
    spark_folders = [i for i in fs.get_file_info(pafs.FileSelector(root)) if i.base_name.startswith("spark-batch-")]
    assert len(spark_folders) >= 5, "Spark wrote the files of the JDBC and Spark-writer batches"


def test_projections_checks_and_maintenance_run_on_the_s3_lake(dsn: StoreDsn, spark: Any, s3: S3Server) -> None:
    """Spark's side on S3 (S3A): the exactly-once check reads `events`, the projections fold it, the checks
    pass, and maintenance compacts every table with delta-rs, each in its update's turn."""
    warehouse = f"{s3.bucket('lake')}/projected-{os.getpid()}"
    run_workload(EventStore(dsn.writer), streams=50, events=800, writers=2, rollback_rate=0.1, max_commit_delay=0)
    extract_all(dsn.extractor, None, warehouse)
    assert assert_exactly_once(spark, warehouse, dsn) == 800
    update_stream_state(Engine(spark=spark), warehouse, domain=SHOP, store_dsn=dsn.extractor)
    update_stream_catalog(Engine(spark=spark), warehouse, store_dsn=dsn.extractor)
    update_event_type_daily(Engine(spark=spark), warehouse, store_dsn=dsn.extractor)
    streams = {s for s, _ in source_events(dsn)}
    assert tables.read(spark, tables.table_path(warehouse, "stream_state")).count() == len(streams)
    daily = tables.read(spark, tables.table_path(warehouse, "event_type_daily")).groupBy().sum("events").first()
    assert daily is not None and daily[0] == 800
    assert_events_checks_pass(spark, warehouse, dsn.extractor)
    maintained = maintain(warehouse, store_dsn=dsn.extractor)
    assert {"events", "stream_state", "stream_catalog", "event_type_daily"} <= maintained.keys()
    assert assert_exactly_once(spark, warehouse, dsn) == 800, "the same events after compaction"
    # The projections go on from their compaction by delta-rs: Spark's next increments read and merge into them.
    run_workload(EventStore(dsn.writer), streams=50, events=200, writers=2, rollback_rate=0.0, max_commit_delay=0)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(Engine(spark=spark, small_increments=False), warehouse, domain=SHOP, store_dsn=dsn.extractor)
    update_event_type_daily(Engine(spark=spark), warehouse, store_dsn=dsn.extractor)
    daily = tables.read(spark, tables.table_path(warehouse, "event_type_daily")).groupBy().sum("events").first()
    assert daily is not None and daily[0] == 1000
    state = tables.read(spark, tables.table_path(warehouse, "stream_state"))
    assert state.count() == len({s for s, _ in source_events(dsn)})
    assert state.groupBy().sum("version").first()[0] == 1000, "every event folded once"
