"""Spark on a real standalone cluster (a master and a worker from the pyspark package), over the lake on
S3: the driver in its own process, the work on the worker's executors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from es_pipeline.dev.s3proxy import S3Server
from es_pipeline.dev.spark_cluster import standalone
from es_pipeline.dev.workload import run_workload
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.lakecheck import extract_all, source_events
from es_pipeline_tests.support.roles import StoreDsn

CLI = str(Path(sys.executable).parent / "es-pipeline")


@pytest.mark.timeout(600)
def test_an_analysts_query_runs_on_the_cluster_over_the_s3_lake(dsn: StoreDsn, s3: S3Server, tmp_path: Path) -> None:
    warehouse = f"{s3.bucket('lake')}/cluster-{os.getpid()}"
    run_workload(EventStore(dsn.writer), streams=40, events=400, writers=2, rollback_rate=0.1, max_commit_delay=0)
    extract_all(dsn.extractor, None, warehouse)
    expected = source_events(dsn)
    with standalone(tmp_path / "cluster") as cluster:
        query = "SELECT count(*) AS n, count(DISTINCT stream_id, version) AS k FROM events"
        done = subprocess.run([CLI, "sql", query], capture_output=True, text=True, timeout=480, check=False,
                              env={**os.environ, "ES_PIPELINE_WAREHOUSE": warehouse,
                                   "ES_PIPELINE_SPARK_MASTER": cluster.master_url})
        assert done.returncode == 0, done.stderr[-3000:]
        header, row = [line.strip("|").split("|") for line in done.stdout.splitlines() if line.startswith("|")]
        assert [int(c) for c in row] == [len(expected), len(expected)]
        with urllib.request.urlopen(f"{cluster.web_ui}/json/", timeout=5) as answer:
            master = json.load(answer)
        apps = master.get("completedapps", []) + master.get("activeapps", [])
        assert [a["name"] for a in apps] == ["es_pipeline"], "the query ran as an application of the cluster"
