"""`new_events_sensor`: a run per slice range with new committed events."""

import dagster as dg
import psycopg
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from es_pipeline.defs.events.asset import RANGE_TAG, TAIL_TAG
from es_pipeline.defs.resources import EventStoreResource
from es_pipeline.errors import EsPipelineError, ReadOnlyStore, SourceChanged, XidSpaceWentBack
from es_pipeline.extraction.offsets import check_source, events_consumer
from es_pipeline.extraction.probe import decide, format_cursor, parse_cursor, probe
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.store.conninfo import connect

WAITING = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED]


def build_new_events_sensor(
    job: UnresolvedAssetJobDefinition, ranges: list[SliceRange], *, interval_seconds: int, tail_seconds: int = 0
) -> dg.SensorDefinition:
    @dg.sensor(
        name="new_events_sensor",
        job=job,
        minimum_interval_seconds=interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=(
            "Each tick asks Postgres, in one statement that reads the newest events from the end of a transaction-order "
            "index (its cost does not grow with the table), which slice ranges have committed "
            "events at or above their watermark and below the horizon, and requests one run per such range "
            "(run_key = range:horizon). The cursor remembers the horizon last requested per range: a hint, "
            "never the truth. Interval: ES_PIPELINE_SENSOR_INTERVAL seconds (default 5). With "
            "ES_PIPELINE_TAIL_SECONDS > 0 its runs tail their range for that long (woken by NOTIFY es_events), "
            "and a range whose tailing run is in progress gets no request."
        ),
    )
    def new_events_sensor(
        context: dg.SensorEvaluationContext, event_store: EventStoreResource
    ) -> dg.SensorResult | dg.SkipReason:
        try:
            with connect(event_store.dsn, autocommit=True, application_name="es_pipeline sensor") as conn:
                consumer = events_consumer(event_store.schema_name)
                check_source(conn, consumer)
                found = probe(conn, event_store.schema_name, consumer)
        except (ReadOnlyStore, SourceChanged, XidSpaceWentBack) as exc:
            return dg.SkipReason(f"no run was requested: {exc}")
        except (EsPipelineError, psycopg.Error) as exc:
            return dg.SkipReason(f"could not read the event store, so nothing was decided: {exc}")
        queued = {
            run.tags.get(RANGE_TAG) or run.tags.get("dagster/partition", "")
            for run in context.instance.get_runs(
                filters=dg.RunsFilter(job_name=job.name, statuses=WAITING), limit=len(ranges) * 4
            )
        }
        # A tailing run in progress will take its range's new commits itself.
        queued |= {
            run.tags.get(RANGE_TAG, "")
            for run in context.instance.get_runs(
                filters=dg.RunsFilter(job_name=job.name, statuses=[dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING],
                                      tags={TAIL_TAG: str(tail_seconds)}), limit=len(ranges) * 4
            )
        } if tail_seconds > 0 else set()
        decision = decide(ranges, found, parse_cursor(context.cursor), queued)
        cursor = format_cursor(decision.cursor)
        if not decision.requests:
            return dg.SensorResult(skip_reason=dg.SkipReason(decision.skip_reason()), cursor=cursor)
        return dg.SensorResult(
            run_requests=[
                dg.RunRequest(partition_key=key, run_key=run_key, tags={
                    RANGE_TAG: key, "es_pipeline/horizon": str(found.horizon),
                    **({TAIL_TAG: str(tail_seconds)} if tail_seconds > 0 else {})})
                for key, run_key in decision.requests
            ],
            cursor=cursor,
        )

    return new_events_sensor
