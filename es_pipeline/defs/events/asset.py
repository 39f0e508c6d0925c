"""The `events` asset: committed events of one slice range, exactly once into Delta; and its job."""

from dataclasses import replace

import dagster as dg
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from es_pipeline.defs.resources import EventStoreResource, SparkResource, WarehouseResource
from es_pipeline.errors import Retryable, explain
from es_pipeline.extraction.extractor import Extractor, ExtractResult, build_extractor
from es_pipeline.extraction.offsets import OffsetSession
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.extraction.tail import tail
from es_pipeline.settings import Settings

RANGE_TAG = "es_pipeline/slice_range"
# On a run the sensor starts when ES_PIPELINE_TAIL_SECONDS > 0: how long the run tails its range. A hand
# materialization carries no such tag and makes one pass.
TAIL_TAG = "es_pipeline/tail_seconds"


def build_events_asset(partitions: dg.PartitionsDefinition, settings: Settings) -> dg.AssetsDefinition:
    """The asset over `partitions`. The resources say where (store, lake, Spark); `settings` say how
    (the writer, and the read path that the Spark master implies)."""

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
        here = replace(settings, pg_dsn=event_store.dsn, schema=event_store.schema_name, warehouse=warehouse.root)
        # The default (Arrow into Delta with delta-rs) starts no JVM: Spark is asked for only if needed.
        extractor = build_extractor(here, lambda: spark.spark_session, progress=context.log.info)
        tail_seconds = float(context.run.tags.get(TAIL_TAG) or 0)

        try:
            with extractor.session(slice_range, context.run.run_id) as session:
                result = _extract(context, extractor, slice_range, session, tail_seconds)
        except Exception as exc:  # a database, Delta or filesystem failure we can name: one line, no traceback
            known = explain(exc)
            if known is None:
                raise
            raise dg.Failure(description=str(known), allow_retries=isinstance(known, Retryable)) from None
        context.log.info(
            f"{slice_range.key}: {result.rows} events in {result.batches} batches below horizon {result.horizon}; "
            f"{result.events_behind} committed events wait behind it"
        )
        return dg.MaterializeResult(
            metadata={**result.metadata(), "spark_session_seconds": round(extractor.spark_seconds, 3)}
        )

    return events


def _extract(
    context: dg.AssetExecutionContext, extractor: Extractor, slice_range: SliceRange, session: OffsetSession,
    tail_seconds: float,
) -> ExtractResult:
    """One pass, or with `tail_seconds`, passes until then: the result the run reports as its own."""
    result = extractor.run(slice_range, run_id=context.run.run_id, session=session)
    if tail_seconds <= 0:
        return result
    # Each pass that moved events is a materialization of the partition; the newest is held back to be the
    # run's own result, so that no pass is reported twice.
    held = [result]

    def reported(pass_result: ExtractResult) -> None:
        if held[0].rows:
            context.log_event(dg.AssetMaterialization(
                asset_key=context.asset_key, partition=context.partition_key, metadata=held[0].metadata()))
        held[0] = pass_result

    tailed = tail(extractor, slice_range, run_id=context.run.run_id, seconds=tail_seconds, on_pass=reported,
                  session=session)
    context.log.info(f"{slice_range.key}: tailed {tail_seconds:.0f} s: {tailed.rows} events in "
                     f"{tailed.passes} passes after {tailed.probes} probes")
    return held[0]


def build_events_job(events: dg.AssetsDefinition) -> UnresolvedAssetJobDefinition:
    """One slice range per run, in process (no step subprocess: seconds of latency per run), without the
    table-wide checks, which run on their own schedule rather than after every increment."""
    return dg.define_asset_job(
        "events_job", selection=dg.AssetSelection.assets(events).without_checks(),
        executor_def=dg.in_process_executor,
        description="Extract one slice range into the Delta `events` table.",
    )
