"""The catalog (lake/read/metastore.py) in Dagster: the `catalog` asset is a sync, its sensor requests one when the
lake and the catalog differ.

Small runs start no JVM, so they never register a table themselves: a run that makes a table (a typed event table a
tailing run meets, a projection's first build), swaps, erases or drops one is followed by a sync within the sensor's
minute. The sensor compares the lake with the catalog's rows in PostgreSQL, without a JVM; the sync starts Spark only
to register or drop the difference. `catalog_matches_lake` checks the asset after each sync and in lake_checks_job.
"""

from collections.abc import Callable

import dagster as dg

from es_pipeline.defs.resources import CatalogResource, WarehouseResource
from es_pipeline.errors import EsPipelineError
from es_pipeline.lake.read.metastore import (
    Metastore,
    Synced,
    difference,
    never_synced,
    session_with,
    sync_lake,
)

JOB = "catalog_job"
_ACTIVE = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
           dg.DagsterRunStatus.STARTED]


@dg.asset(name="catalog", group_name="catalog", kinds={"hive", "postgres"},
          description="Every Delta table of the lake by name in the catalog (a Hive metastore in PostgreSQL, "
          "`ES_PIPELINE_METASTORE_DSN`), schema `ES_PIPELINE_CATALOG_SCHEMA` (`es`): a sync registers the tables the "
          "catalog lacks and drops those the lake no longer has; Spark starts only for a difference.")
def catalog(context: dg.AssetExecutionContext, metastore: CatalogResource,
            warehouse: WarehouseResource) -> dg.MaterializeResult:
    ms = metastore.metastore()
    if ms is None:
        return dg.MaterializeResult(metadata={"note": "no catalog: ES_PIPELINE_METASTORE_DSN=off"})
    done = metastore_sync(ms, warehouse, metastore.spark_config, context.log.info)
    return dg.MaterializeResult(metadata={
        "schema": done.schema, "tables": done.tables, "registered": ", ".join(done.registered) or "-",
        "dropped": ", ".join(done.dropped) or "-", "spark_started": done.jvm,
        "seconds": round(done.seconds, 1)})


def metastore_sync(ms: Metastore, warehouse: WarehouseResource, spark_config: dict[str, str],
                   say: Callable[[str], None]) -> Synced:
    return sync_lake(ms, warehouse.root, lambda: session_with(dict(spark_config), ms), say)


catalog_job = dg.define_asset_job(
    JOB, selection=dg.AssetSelection.assets(catalog), executor_def=dg.in_process_executor,
    description="The catalog made equal to the lake, then checked (catalog_matches_lake).",
    tags={"es_pipeline/maintenance": "catalog"})


def build_catalog_sensor(*, running: bool) -> dg.SensorDefinition:
    @dg.sensor(name="catalog_sensor", job=catalog_job, minimum_interval_seconds=60,
               default_status=dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED,
               description="Syncs the catalog when the lake's tables and the catalog's differ (read without a JVM).")
    def catalog_sensor(context: dg.SensorEvaluationContext, metastore: CatalogResource,
                       warehouse: WarehouseResource) -> dg.RunRequest | dg.SkipReason:
        ms = metastore.metastore()
        if ms is None:
            return dg.SkipReason("no catalog: ES_PIPELINE_METASTORE_DSN=off")
        if context.instance.get_runs(dg.RunsFilter(job_name=JOB, statuses=_ACTIVE), limit=1):
            return dg.SkipReason("a sync is in progress")
        try:
            diff = difference(ms, warehouse.root) if not never_synced(ms) else None
        except EsPipelineError as exc:
            return dg.SkipReason(str(exc))
        if diff is not None and not diff:
            return dg.SkipReason("the catalog names the lake's tables")
        return dg.RunRequest(tags={"es_pipeline/catalog": (diff.describe() if diff else "first sync")[:200]})

    return catalog_sensor
