"""The `events` asset: committed events of one slice range, exactly once into Delta."""


import time

import dagster as dg

from es_pipeline.extract import Extractor, default_jdbc_min_rows
from es_pipeline.resources import EventStoreResource, SparkResource, WarehouseResource
from es_pipeline.settings import Settings
from es_pipeline.slices import SliceRange

RANGE_TAG = "es_pipeline/slice_range"


def build_events_asset(partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(
        name="events",
        partitions_def=partitions,
        kinds={"delta", "postgres", "arrow"},
        owners=["team:data-engineering"],
        tags={"layer": "raw"},
        description=(
            "Every committed event of the event store, once, keyed by (stream_id, version). Each "
            "partition is a slice range; a run copies the events with W(slice) <= tx_id < H, where H is "
            "the Postgres horizon pg_snapshot_xmin(pg_current_snapshot()) and W the per-slice watermark."
        ),
    )
    def events(
        context: dg.AssetExecutionContext,
        event_store: EventStoreResource,
        spark: SparkResource,
        warehouse: WarehouseResource,
    ) -> dg.MaterializeResult:
        slice_range = SliceRange.from_key(context.partition_key)
        settings = Settings.from_env()
        jdbc_min_rows = default_jdbc_min_rows(settings.spark_master)
        session, spark_seconds = None, 0.0
        if settings.events_writer == "spark" or jdbc_min_rows > 0:
            # Only these need Spark; the default (Arrow into Delta with delta-rs) starts no JVM.
            t0 = time.monotonic()
            session = spark.spark_session  # a local JVM start, or attaching to a Spark Connect server
            spark_seconds = time.monotonic() - t0
        extractor = Extractor(
            dsn=event_store.dsn,
            spark=session,
            warehouse=warehouse.root,
            schema=event_store.schema_name,
            progress=context.log.info,
            writer=settings.events_writer,
            jdbc_min_rows=jdbc_min_rows,
        )
        result = extractor.run(slice_range, run_id=context.run.run_id)
        context.log.info(
            f"{slice_range.key}: {result.rows} events in {result.batches} batches below horizon {result.horizon}; "
            f"{result.events_behind} committed events wait behind it"
        )
        return dg.MaterializeResult(metadata={**result.metadata(), "spark_session_seconds": round(spark_seconds, 3)})

    return events
