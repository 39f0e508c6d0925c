"""`new_events_sensor`: with tailing runs (the default), one run over every range, and the next one queued near its
end; with `ES_PIPELINE_TAIL_SECONDS=0`, a run per slice range with new committed events."""

import time

import dagster as dg
import psycopg
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from es_pipeline.defs.resources import EventStoreResource
from es_pipeline.errors import (
    EsPipelineError,
    FutureTransactionIds,
    ReadOnlyStore,
    SourceChanged,
    XidSpaceWentBack,
)
from es_pipeline.extraction.offsets import check_source
from es_pipeline.extraction.probe import Probe, decide, format_cursor, parse_cursor, probe, retry_key
from es_pipeline.extraction.slices import NUM_SLICES, SliceRange
from es_pipeline.extraction.tail import RANGE_TAG, TAIL_TAG
from es_pipeline.store.conninfo import KeptConnection

WAITING = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED]
IN_PROGRESS = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED]


def build_new_events_sensor(
    job: UnresolvedAssetJobDefinition, ranges: list[SliceRange], *, interval_seconds: int, tail_seconds: int = 0
) -> dg.SensorDefinition:
    # The code server evaluates tick after tick in one process: one connection per store, kept between them.
    store_connections: dict[str, KeptConnection] = {}

    @dg.sensor(
        name="new_events_sensor",
        job=job,
        minimum_interval_seconds=interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=(
            "Each tick asks Postgres, reading the newest events from the end of a transaction-order "
            "index (its cost does not grow with the table), which slice ranges have committed "
            "events at or above their watermark and below the horizon, and requests one run per such range "
            "(run_key = range:horizon). The cursor remembers the horizon last requested per range: a hint, "
            "never the truth. Interval: ES_PIPELINE_SENSOR_INTERVAL seconds (default 5, or 15 with tailing runs). With "
            "ES_PIPELINE_TAIL_SECONDS > 0 it requests instead one run over every range, which tails them for that "
            "long (woken by NOTIFY es_events); none while that run is queued or far from its end, and the next "
            "one as it nears its end (queued behind it, it starts as soon as that one ends)."
        ),
    )
    def new_events_sensor(
        context: dg.SensorEvaluationContext, event_store: EventStoreResource
    ) -> dg.SensorResult | dg.SkipReason:
        # First, and without a connection to the store: a tailing run takes the new commits itself (and checks
        # the store's identity every pass), so the tick has nothing to ask the store until that run nears its end.
        if tail_seconds > 0:
            busy = _tailing_busy(context.instance, job.name, tail_seconds, handoff=2 * interval_seconds + 5)
            if busy:
                return dg.SkipReason(busy)
        try:
            source = event_store.events_source()
            kept = store_connections.setdefault(event_store.dsn, KeptConnection(event_store.dsn, "es_pipeline sensor"))

            def ask(conn: psycopg.Connection) -> Probe:
                try:
                    check_source(conn, source.consumer, source)
                except FutureTransactionIds as exc:
                    if not exc.fresh:
                        raise
                    # Nothing extracted yet: a run rebases by itself where the lake is empty (or says why not),
                    # so every range is asked for, though the restored events all lie above the horizon.
                    found = probe(conn, source, source.consumer)
                    return Probe(found.horizon, frozenset(range(NUM_SLICES)))
                return probe(conn, source, source.consumer)

            found = kept.run(ask)
        except (ReadOnlyStore, SourceChanged, XidSpaceWentBack, FutureTransactionIds) as exc:
            return dg.SkipReason(f"no run was requested: {exc}")
        except (EsPipelineError, psycopg.Error) as exc:
            return dg.SkipReason(f"could not read the event store, so nothing was decided: {exc}")
        queued = {
            run.tags.get(RANGE_TAG) or run.tags.get("dagster/partition", "")
            for run in context.instance.get_runs(
                filters=dg.RunsFilter(job_name=job.name, statuses=WAITING), limit=len(ranges) * 4
            )
        }
        failed = _failed_last(context.instance, job.name, limit=len(ranges) * 4)
        whole = SliceRange(ranges[0].lo, ranges[-1].hi).key
        decision = decide(ranges, found, parse_cursor(context.cursor), queued,
                          failed if tail_seconds <= 0 else {r.key: failed[whole] for r in ranges if whole in failed})
        cursor = format_cursor(decision.cursor)
        if not decision.requests:
            return dg.SensorResult(skip_reason=dg.SkipReason(decision.skip_reason()), cursor=cursor)
        if tail_seconds > 0:
            after = failed[whole][1] if failed.get(whole, (None, ""))[0] == found.horizon else None
            return dg.SensorResult(run_requests=[tailing_request(ranges, found.horizon, tail_seconds, after=after)],
                                   cursor=cursor)
        return dg.SensorResult(
            run_requests=[
                dg.RunRequest(partition_key=key, run_key=run_key, tags={
                    RANGE_TAG: key, "es_pipeline/horizon": str(found.horizon)})
                for key, run_key in decision.requests
            ],
            cursor=cursor,
        )

    return new_events_sensor


RETRY_AFTER_SECONDS = 60.0  # a run that failed is asked again at the same horizon once it ended this long ago


def _failed_last(instance: dg.DagsterInstance, job_name: str, *, limit: int) -> dict[str, tuple[int, str]]:
    """Per range (its tag), (horizon, run id) of its newest run where that run failed or was canceled at least
    RETRY_AFTER_SECONDS ago: the ranges `decide` asks again at the same horizon (a retry a minute at most)."""
    out: dict[str, tuple[int, str]] = {}
    seen: set[str] = set()
    for record in instance.get_run_records(filters=dg.RunsFilter(job_name=job_name), limit=limit):
        run = record.dagster_run
        key = run.tags.get(RANGE_TAG) or run.tags.get("dagster/partition", "")
        if key in seen:
            continue
        seen.add(key)
        ended = record.end_time or record.update_timestamp.timestamp()
        horizon = run.tags.get("es_pipeline/horizon", "")
        if (run.status in (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED) and horizon.isdigit()
                and time.time() - ended >= RETRY_AFTER_SECONDS):
            out[key] = (int(horizon), run.run_id)
    return out


def _tailing_busy(instance: dg.DagsterInstance, job_name: str, tail_seconds: int, *, handoff: float) -> str | None:
    """Why this tick requests no tailing run, or None when it may: none is queued, and the one in progress (if
    any) ends within `handoff` seconds. The next one is requested then, waits in the queue (one run per range
    at a time) and starts as soon as this one ends: no gap of a sensor interval between two runs."""
    records = instance.get_run_records(filters=dg.RunsFilter(
        job_name=job_name, statuses=[*WAITING, *IN_PROGRESS], tags={TAIL_TAG: str(tail_seconds)}), limit=4)
    if any(r.dagster_run.status in WAITING for r in records):
        return "the next tailing run is queued: it starts when the one in progress ends"
    for r in records:
        ends = (r.start_time or time.time()) + tail_seconds
        if ends - time.time() > handoff:
            return (f"a tailing run is in progress and takes every range's new commits itself "
                    f"(for {ends - time.time():.0f} s more)")
    return None


def tailing_request(
    ranges: list[SliceRange], horizon: int, tail_seconds: int, *, after: str | None = None
) -> dg.RunRequest:
    """One run over every range (a partition range, first key to last): its passes take all the store's new
    commits in one Delta commit and one offsets transaction each, where a run per range would make as many.
    `after`: the run that failed at this horizon, which this one retries (its own run key)."""
    whole = SliceRange(ranges[0].lo, ranges[-1].hi)
    key = f"tail:{horizon}"
    return dg.RunRequest(run_key=retry_key(key, after) if after else key, tags={
        ASSET_PARTITION_RANGE_START_TAG: ranges[0].key, ASSET_PARTITION_RANGE_END_TAG: ranges[-1].key,
        RANGE_TAG: whole.key, TAIL_TAG: str(tail_seconds), "es_pipeline/horizon": str(horizon)})
