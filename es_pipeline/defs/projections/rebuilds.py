"""The rebuilds beside `stream_state` (lake/state/rebuild.py) in a job of their own, launched by a sensor.

A stream type whose fold changed (a revision, an upcaster, its history turned on) is rebuilt beside the live table
and swapped in when caught up. It runs in its own job, not in `stream_state`'s asset run: that run ends after its
increment, so the automation goes on launching the next ones (every other type fresh) for as long as a rebuild
of hours lasts. The sensor looks every minute (reading `stream_state`'s stream types and revisions) and
requests a run where a type waits and none is in progress; `ES_PIPELINE_REBUILDS=hold` leaves it stopped.
"""

import dagster as dg

from es_pipeline.defs.resources import EventStoreResource, SparkResource, WarehouseResource, engine_of
from es_pipeline.domain import Domain
from es_pipeline.lake.state import rebuild

JOB = "stream_state_rebuilds_job"
_ACTIVE = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
           dg.DagsterRunStatus.STARTED]


def build_rebuilds_job(domain: Domain) -> dg.JobDefinition:
    """The job: every pending rebuild built beside `stream_state` and swapped in (`rebuild.run_pending`)."""

    @dg.op(name="stream_state_rebuilds", description="Every stream type whose fold changed, rebuilt beside "
           "stream_state (pieces, catch-up) and swapped in by one commit; resumed where a run stopped.")
    def rebuild_op(context: dg.OpExecutionContext, spark: SparkResource, warehouse: WarehouseResource,
                   event_store: EventStoreResource) -> None:
        swapped = rebuild.run_pending(engine_of(warehouse, spark), warehouse.root, domain, event_store.dsn,
                                      say=context.log.info)
        context.log.info(f"swapped into stream_state: {', '.join(swapped) or 'none'}")

    @dg.job(name=JOB, description="Rebuilds beside stream_state (a reducer revision, an upcaster, a history turned "
            "on): the other stream types stay fresh meanwhile.", tags={"es_pipeline/maintenance": "rebuild"})
    def job() -> None:
        rebuild_op()

    return job


def build_rebuilds_sensor(job: dg.JobDefinition, domain: Domain, *, running: bool) -> dg.SensorDefinition:
    """Requests `job` where a stream type waits for its rebuild and no run of it is in progress."""

    @dg.sensor(name="stream_state_rebuilds_sensor", job=job, minimum_interval_seconds=60,
               default_status=dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED,
               description="Launches stream_state_rebuilds_job when a stream type's fold changed "
               "(ES_PIPELINE_REBUILDS=hold: stopped).")
    def stream_state_rebuilds_sensor(context: dg.SensorEvaluationContext,
                                     warehouse: WarehouseResource) -> dg.RunRequest | dg.SkipReason:
        if context.instance.get_runs(dg.RunsFilter(job_name=job.name, statuses=_ACTIVE), limit=1):
            return dg.SkipReason("a rebuild run is in progress")
        todo = rebuild.waiting(warehouse.root, domain)
        if not todo:
            return dg.SkipReason("no stream type to rebuild")
        return dg.RunRequest(tags={"es_pipeline/rebuild": ",".join(todo)[:200]})

    return stream_state_rebuilds_sensor
