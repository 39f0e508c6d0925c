"""Snapshots reach the store: materialized through Dagster (as the extractor's and the snapshot writer's
logins), the store's table equals the lake's latest, row by row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
from shop.domain import domain as SHOP

from es_pipeline.defs.checks import BUILTIN as CHECKS
from es_pipeline.defs.projections.assets import build_stream_state_asset
from es_pipeline.defs.resources import EventStoreResource
from es_pipeline.defs.snapshots.asset import snapshots
from es_pipeline.dev.workload import run_workload
from es_pipeline.lake.delta import tables
from es_pipeline.location import build_definitions
from es_pipeline.settings import Settings
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.lakecheck import extract_all
from es_pipeline_tests.support.roles import StoreDsn
from es_pipeline_tests.support.store import stored_snapshots


def _lake_latest(spark: Any, warehouse: Path) -> dict[str, tuple[int, int, Any]]:
    latest: dict[str, tuple[int, int, Any]] = {}
    for r in tables.read(spark, str(warehouse / "snapshots")).collect():
        if r["stream_id"] not in latest or (r["version"], r["revision"]) > latest[r["stream_id"]][:2]:
            latest[r["stream_id"]] = (r["version"], r["revision"], json.loads(r["state"]))
    return latest


def test_every_snapshot_in_the_lake_is_written_back_and_a_lost_write_back_is_redone(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path
) -> None:
    run_workload(EventStore(dsn.writer), streams=60, events=900, writers=2, rollback_rate=0, max_commit_delay=0)
    extract_all(settings.pg_dsn, spark, warehouse)
    defs = build_definitions(settings, SHOP)
    assets = [build_stream_state_asset(SHOP), snapshots]
    resources = dict(defs.resources)
    config = {"ops": {"snapshots": {"config": {"threshold": 5}}}}
    with dg.instance_for_test() as instance:
        # Least privilege: the extractor's login reads the store (it may not write snapshots), the
        # snapshot writer's own login (ES_PIPELINE_SNAPSHOT_DSN) does the write-back.
        resources["event_store"] = EventStoreResource(dsn=dsn.extractor, snapshot_dsn=dsn.snapshots)
        res = dg.materialize(assets, resources=resources, run_config=config, instance=instance)
        assert res.success
        meta = res.asset_materializations_for_node("snapshots")[0].metadata
        taken = meta["dagster/row_count"].value
        assert isinstance(taken, int) and taken > 0
        assert meta["written_back"].value == taken

        lake = _lake_latest(spark, warehouse)
        assert len(lake) == taken
        assert stored_snapshots(dsn) == lake  # row by row: version, revision and state

        def check() -> dg.AssetCheckResult:
            return CHECKS["snapshots_match_store"](  # type: ignore[operator]
                dg.build_asset_check_context(), spark=resources["spark"], warehouse=resources["warehouse"],
                event_store=resources["event_store"])

        assert check().passed
        # A write-back lost (a run that died after its Delta commit): the check fails, the next run redoes it.
        with psycopg.connect(dsn, autocommit=True) as conn:
            gone = conn.execute("DELETE FROM es.snapshots WHERE stream_id IN "
                                "(SELECT stream_id FROM es.snapshots ORDER BY stream_id LIMIT 3)").rowcount
        assert gone == 3
        failed = check()
        assert not failed.passed and failed.metadata["streams_differing"].value == 3
        again = dg.materialize([assets[1]], resources=resources, run_config=config, instance=instance)
        meta = again.asset_materializations_for_node("snapshots")[0].metadata
        assert meta["dagster/row_count"].value == 0 and meta["written_back"].value == 3
        assert stored_snapshots(dsn) == lake
        assert check().passed
