"""Asset checks have teeth: they fail on a broken table and pass on a good one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg

from es_pipeline.defs.events import checks as events_checks
from es_pipeline.defs.maintenance.jobs import CHECKS
from es_pipeline.defs.projections import checks as projections_checks
from es_pipeline.defs.resources import EventStoreResource, SparkResource, WarehouseResource
from es_pipeline.dev.workload import run_workload
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.lake import tables
from es_pipeline.lake.spark import spark_conf
from es_pipeline.lake.stream_state import update_stream_state
from es_pipeline.settings import Settings
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.roles import StoreDsn


def _resources(s: Settings) -> dict[str, Any]:
    return {
        "spark": SparkResource(spark_config=spark_conf(s)),
        "warehouse": WarehouseResource(path=str(s.warehouse)),
        "event_store": EventStoreResource(dsn=s.pg_dsn),
    }


def _run(check: Any, r: dict[str, Any]) -> dg.AssetCheckResult:
    names = check.node_def.required_resource_keys if hasattr(check, "node_def") else set()
    return check(**{k: v for k, v in r.items() if k in names})


def test_checks_pass_on_a_good_lake_and_fail_on_broken_ones(
    dsn: StoreDsn, settings: Settings, spark: Any, warehouse: Path
) -> None:
    run_workload(EventStore(dsn.writer), streams=40, events=300, writers=2, rollback_rate=0, max_commit_delay=0)
    Extractor(settings.pg_dsn, spark, warehouse).run(SliceRange(0, 1023))
    update_stream_state(spark, warehouse)
    r = _resources(settings)
    for check in CHECKS:
        assert _run(check, r).passed, check.check_key.name

    events = str(warehouse / "events")
    df = tables.read(spark, events)
    victim = df.where("version = 1").orderBy("stream_id").first()
    # A duplicate row: the duplicate check fails; reconcile fails too (one more than the source).
    df.where(f"stream_id = '{victim['stream_id']}' AND version = 1").write.format("delta").mode("append").save(events)
    assert not _run(events_checks.events_no_duplicates, r).passed
    assert not _run(events_checks.events_reconcile_with_source, r).passed
    # A lost row below the watermark: contiguity and reconcile fail.
    spark.sql(f"DELETE FROM delta.`{events}` WHERE stream_id = '{victim['stream_id']}' AND version = 1")
    assert _run(events_checks.events_no_duplicates, r).passed
    assert not _run(events_checks.events_versions_contiguous, r).passed
    assert not _run(events_checks.events_reconcile_with_source, r).passed
    # A stream_state row behind its events.
    spark.sql(f"UPDATE delta.`{warehouse / 'stream_state'}` SET version = version - 1 WHERE stream_id = '{victim['stream_id']}'")
    assert not _run(projections_checks.stream_state_version_matches_events, r).passed
