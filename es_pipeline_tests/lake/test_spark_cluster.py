"""Spark on a real standalone cluster (a master and a worker from the pyspark package), over the lake on
S3: the driver in its own process (an analyst's `es-pipeline sql`, or a Spark Connect server on the
cluster that Dagster's runs attach to), the work on the worker's executors. One cluster for the module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.dev.connect_token import TOKEN_ENV
from es_pipeline.dev.s3proxy import S3Server
from es_pipeline.dev.spark_cluster import SparkCluster, connect_server, standalone
from es_pipeline.dev.workload import bulk_load, run_workload
from es_pipeline.lake import cross_stream
from es_pipeline.lake.delta import tables
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.typed import event_tables
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.lakecheck import extract_all, source_events
from es_pipeline_tests.support.roles import StoreDsn

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def cluster(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    """The module's cluster; its worker (and so every executor) has the S3 server's AWS_* variables."""
    with standalone(tmp_path_factory.mktemp("cluster")) as running:
        yield running


def _applications(cluster: SparkCluster) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{cluster.web_ui}/json/", timeout=5) as answer:  # noqa: S310 - the local master
        master = json.load(answer)
    return list(master.get("completedapps", [])) + list(master.get("activeapps", []))


@pytest.mark.timeout(600)
def test_an_analysts_query_runs_on_the_cluster_over_the_s3_lake(
    dsn: StoreDsn, s3: S3Server, cluster: SparkCluster
) -> None:
    warehouse = f"{s3.bucket('lake')}/cluster-{os.getpid()}"
    run_workload(EventStore(dsn.writer), streams=40, events=400, writers=2, rollback_rate=0.1, max_commit_delay=0)
    extract_all(dsn.extractor, None, warehouse)
    expected = source_events(dsn)
    query = "SELECT count(*) AS n, count(DISTINCT stream_id, version) AS k FROM events"
    done = subprocess.run([str(BIN / "es-pipeline"), "sql", query, "--engine", "spark", "--format", "csv"],
                          capture_output=True, text=True, timeout=480, check=False,
                          env={**os.environ, "ES_PIPELINE_WAREHOUSE": warehouse,
                               "ES_PIPELINE_SPARK_MASTER": cluster.master_url})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["n,k", f"{len(expected)},{len(expected)}"]
    assert "es_pipeline" in [a["name"] for a in _applications(cluster)], "the query ran as an application of the cluster"


def _dagster(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(BIN / "dagster"), *args, "-m", "es_pipeline.definitions"], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"dagster {' '.join(args)}:\n{done.stderr[-4000:]}"
    return done


@pytest.mark.timeout(900)
def test_dagster_runs_on_the_cluster_extract_project_check_and_maintain_the_s3_lake(
    dsn: StoreDsn, s3: S3Server, cluster: SparkCluster, tmp_path: Path
) -> None:
    """Dagster's runs attach to a Spark Connect server whose driver runs on the cluster: the executors read
    the backfill over JDBC and write its Parquet files to S3 (delta-rs commits them), then the projections
    and the checks run on the cluster too, and the maintenance job (delta-rs) compacts the lake on S3. The
    lake equals the store, event by event."""
    bulk_load(dsn, events=BULK, streams=60, events_per_tx=500)
    run_workload(EventStore(dsn.writer), streams=30, events=600, writers=2, rollback_rate=0.1, max_commit_delay=0)
    store = EventStore(dsn.writer)
    for i in range(TYPES):  # a typed table per type, all built in two Spark jobs
        store.append(f"kinds-{i}", "kinds", [NewEvent(f"Kind{i}Noted", {"n": i, "at": {"k": f"v{i}"}}),
                                             NewEvent(f"Kind{i}Noted", {"n": i / 2, "extra": [i]})], 0)
    warehouse = f"{s3.bucket('lake')}/dagster-cluster-{os.getpid()}"
    home = tmp_path / "dagster_home"
    home.mkdir()
    token = os.urandom(16).hex()
    env = {**os.environ, "ES_PIPELINE_WAREHOUSE": warehouse, "ES_PIPELINE_SPARK_MASTER": cluster.master_url,
           TOKEN_ENV: token, "DAGSTER_HOME": str(home), "ES_PIPELINE_SLICE_RANGES": "1",
           "ES_PIPELINE_AUTOMATION": "off", "ES_PIPELINE_PG_DSN": dsn.extractor,
           "ES_PIPELINE_JDBC_MIN_ROWS": "1000", "ES_PIPELINE_BATCH_EVENTS": "2000",
           "ES_PIPELINE_DOMAIN": "shop.domain", "ES_PIPELINE_ENGINE": "spark"}
    with connect_server(env, tmp_path / "connect.log") as remote:
        env["ES_PIPELINE_SPARK_REMOTE"] = remote
        extracted = _dagster(["asset", "materialize", "--select", "events", "--partition", "0000-1023"], env)
        _dagster(["asset", "materialize", "--select",
                  "stream_state,stream_catalog,event_type_daily,sku_sales,event_tables"], env)
        _dagster(["job", "execute", "-j", "delta_maintenance_job"], env)
        connect_apps = [a for a in _applications(cluster) if a["name"] == "es_pipeline-connect"]
    assert connect_apps and connect_apps[0]["cores"] > 0, "the Connect server's driver had executors on the cluster"
    said = extracted.stdout + extracted.stderr
    assert "on 'events' passed." in said and "did not pass" not in said, "the events checks ran, on the cluster, and passed"

    events = tables.table_path(warehouse, "events")
    table = DeltaTable(events)
    history = table.history()
    assert all("delta-rs" in str(h.get("clientVersion", "")) for h in history), "delta-rs made every commit to events"
    assert Counter(h["operation"] for h in history)["OPTIMIZE"] == 1, "the maintenance job compacted events"
    fs, root = tables.filesystem(events)
    spark_folders = [i for i in fs.get_file_info(pafs.FileSelector(root)) if i.base_name.startswith("spark-batch-")]
    assert len(spark_folders) >= 3, "the executors wrote the large batches' files"
    lake = table.to_pyarrow_table(columns=["stream_id", "version", "payload"])
    keys = list(zip(lake["stream_id"].to_pylist(), lake["version"].to_pylist(), strict=True))
    expected = source_events(dsn)
    assert len(keys) == len(set(keys)) == len(expected) == EVENTS
    assert dict(zip(keys, lake["payload"].to_pylist(), strict=True)) == expected

    state = DeltaTable(tables.table_path(warehouse, "stream_state")).to_pyarrow_table(columns=["stream_id"])
    assert state.num_rows == len({s for s, _ in expected})
    daily = DeltaTable(tables.table_path(warehouse, "event_type_daily")).to_pyarrow_table(columns=["events"])
    assert sum(daily["events"].to_pylist()) == EVENTS

    # The shop's cross-stream projection, built whole on the cluster (ES_PIPELINE_ENGINE=spark): its rows are the
    # files the executors wrote, committed by delta-rs; a rebuild in this process gives the same rows.
    sku_sales = tables.table_path(warehouse, "sku_sales")
    built = _as_built(sku_sales)
    by_spark = {r["sku"]: {c: v for c, v in r.items() if c != "updated_at"} for r in built.to_pyarrow_table().to_pylist()}
    cross_stream.mark_for_rebuild(warehouse, "sku_sales", str(table.metadata().id))
    assert cross_stream.update(warehouse, SHOP, "sku_sales", engine=Engine("local")).engine == "local"
    in_process = {r["sku"]: {c: v for c, v in r.items() if c != "updated_at"}
                  for r in DeltaTable(sku_sales).to_pyarrow_table().to_pylist()}
    assert by_spark and in_process == by_spark

    # The typed event tables (the shop's and the kinds), built whole on the cluster: each table's files are the
    # executors', and a rebuild in this process gives the same columns and rows.
    names = event_tables.table_names(warehouse)[1:]
    assert len(names) >= TYPES + 7
    by_spark = {name: _rows(_as_built(tables.table_path(warehouse, name))) for name in names}
    DeltaTable(tables.table_path(warehouse, event_tables.NAME)).alter.set_table_properties(
        {event_tables.BUILT_FOR: event_tables.BUILDING}, raise_if_not_exists=False)
    again = event_tables.update(warehouse, SHOP, engine=Engine("local"))
    assert again.full_rebuild and again.engine == "local" and again.events_folded == EVENTS
    assert {name: _rows(DeltaTable(tables.table_path(warehouse, name))) for name in names} == by_spark


# Enough types that the typed tables are built in two Spark jobs whatever their number, not one per table (hundreds of
# types are lake/test_event_tables.py's and defs/test_event_tables_asset.py's: in process, on a worker's session);
# enough events, with the batch cap of 2,000, for the executors to write three large batches or more.
TYPES = 40
BULK = 6500
EVENTS = BULK + 600 + 2 * TYPES


def _as_built(path: str) -> DeltaTable:
    """The table at its last version before the maintenance job compacted it, whose files the executors wrote."""
    history = DeltaTable(path).history()
    written = max(int(h["version"]) for h in history if h.get("operation") not in ("OPTIMIZE", "VACUUM START",
                                                                                    "VACUUM END"))
    built = DeltaTable(path, version=written)
    assert built.file_uris() and all("/spark-build-" in uri for uri in built.file_uris()), built.file_uris()[:3]
    return built


def _rows(table: DeltaTable) -> tuple[list[str], dict[tuple[str, str, int], dict[str, Any]]]:
    rows = table.to_pyarrow_table()
    return sorted(rows.column_names), {(r["tenant"], r["stream_id"], r["version"]): r for r in rows.to_pylist()}
