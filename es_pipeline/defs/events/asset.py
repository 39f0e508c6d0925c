"""The `events` asset: committed events of one slice range, exactly once into Delta; and its job."""

import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import dagster as dg
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from es_pipeline.defs.resources import EventStoreResource, SparkResource, WarehouseResource
from es_pipeline.defs.stopping import stop_requests
from es_pipeline.domain import Domain
from es_pipeline.errors import Retryable, explain
from es_pipeline.extraction.extractor import Extractor, ExtractResult, build_extractor
from es_pipeline.extraction.offsets import OffsetSession, batch_frontier
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.extraction.tail import TAIL_TAG, Reports, tail
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.follow import Follower
from es_pipeline.settings import Settings
from es_pipeline.store.conninfo import lock_transaction


def build_events_asset(
    partitions: dg.PartitionsDefinition, settings: Settings, domain: Domain
) -> dg.AssetsDefinition:
    """The asset over `partitions`. The resources say where (store, lake, Spark); `settings` say how
    (the writer, and the read path that the Spark master implies); `domain`: the reducers a tailing run's
    `stream_state` increments fold with."""

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
    ) -> Iterator[dg.MaterializeResult]:
        # One range; or, for a tailing run, every range (a partition range, first key to last), taken as one.
        keys = list(context.partition_keys)
        slice_range = SliceRange(SliceRange.from_key(keys[0]).lo, SliceRange.from_key(keys[-1]).hi)
        here = replace(settings, pg_dsn=event_store.dsn, schema=event_store.schema_name,
                       source_mapping=event_store.events_source(), warehouse=warehouse.root)
        # The default (Arrow into Delta with delta-rs) starts no JVM: Spark is asked for only if needed.
        extractor = build_extractor(here, lambda: spark.spark_session, progress=context.log.info)
        tail_seconds = float(context.run.tags.get(TAIL_TAG) or 0)

        try:
            # Asked to stop (make dev's Ctrl-C, a deploy, Terminate): the pass in progress commits, and the run ends.
            with stop_requests(context, finish=True) as stop, \
                    extractor.session(slice_range, context.run.run_id) as session:
                if tail_seconds > 0:  # a generator: the projections' last reports come after events' own (0046)
                    yield from _tail(context, extractor, slice_range, session, tail_seconds, keys,
                                     report_seconds=settings.report_seconds, follow_seconds=settings.follow_seconds,
                                     follow=here.pg_dsn if settings.automation else None, domain=domain, stop=stop)
                    return
                result = extractor.run(slice_range, run_id=context.run.run_id, session=session)
        except Exception as exc:  # a database, Delta or filesystem failure we can name: one line, no traceback
            known = explain(exc)
            if known is None:
                raise
            raise dg.Failure(description=str(known), allow_retries=isinstance(known, Retryable)) from None
        context.log.info(
            f"{slice_range.key}: {result.rows} events in {result.batches} batches below horizon {result.horizon}; "
            f"{result.events_behind} committed events wait behind it"
        )
        yield dg.MaterializeResult(
            metadata={**result.metadata(), "spark_session_seconds": round(extractor.spark_seconds, 3)}
        )

    return events


def _tail(
    context: dg.AssetExecutionContext, extractor: Extractor, slice_range: SliceRange, session: OffsetSession,
    tail_seconds: float, keys: list[str], *, report_seconds: float, follow_seconds: float, follow: str | None,
    domain: Domain,
    stop: threading.Event,
) -> Iterator[dg.MaterializeResult]:
    """Passes over `slice_range` for `tail_seconds`, reported as materializations of the partitions they
    brought events to (`_Reports`: at most every `report_seconds`, each with the rows of the passes since the
    last); the run's own materialization of its partitions then sums the run up, without a row count of
    its own.

    With `follow` (the store's DSN, where the projections' automation is on), the projections' small
    increments are folded in too, every `follow_seconds` (ES_PIPELINE_FOLLOW_SECONDS; 0: every pass) and
    before each report, and reported as materializations of those projections right after the report of
    `events` (and after the run's own materialization at its end); what needs Spark, or fails, is left to
    the automation's runs. The order is what the automation reads (AFTER_EVENTS, defs/projections/assets.py):
    a table materialized after `events` kept up with it; one that was not (skipped, failed) is behind it, and
    its automation's run comes."""
    reports = _Reports(context, keys, report_seconds)
    projections = _Projections(context, extractor.warehouse, follow, domain, extractor.consumer, follow_seconds)

    def report() -> None:  # the follow first: its report, after events', covers every event that one reports
        projections.maybe_update(force=True)
        reports.flush()
        projections.flush()

    def on_pass(result: ExtractResult) -> None:
        if reports.add(result):
            report()
        else:
            projections.maybe_update()  # between reports, at most every follow_seconds

    def on_idle() -> None:  # passes gathered, and none comes to report them: reported once their gap is over
        if reports.due():
            report()

    with projections:
        first = extractor.run(slice_range, run_id=context.run.run_id, session=session)
        if first.rows:
            on_pass(first)
        tailed = tail(extractor, slice_range, run_id=context.run.run_id, seconds=tail_seconds, on_pass=on_pass,
                      session=session, stop=stop, on_idle=on_idle)
        if not stop.is_set():  # asked to stop: the projections' automation takes what is left
            projections.maybe_update(force=True)
        reports.flush()
        last = tailed.last or first
        ended = "asked to stop, " if stop.is_set() else ""
        context.log.info(f"{slice_range.key}: {ended}tailed {tail_seconds:.0f} s: {first.rows + tailed.rows} events "
                         f"in {reports.passes} passes after {tailed.probes} probes")
        yield dg.MaterializeResult(metadata={
            "run_events": first.rows + tailed.rows, "passes": reports.passes, "probes": tailed.probes,
            "tail_seconds": tail_seconds, "horizon": last.horizon, "events_behind_horizon": last.events_behind,
            "oldest_open_tx_seconds": round(last.oldest_open_tx_seconds, 3), "stopped_early": stop.is_set(),
        })
        if not stop.is_set():  # after the run's own materialization of events, which they kept up with
            projections.flush()


class _Reports(Reports):
    """`Reports` (extraction/tail.py), each report logged as materializations of the partitions it covers."""

    def __init__(self, context: dg.AssetExecutionContext, keys: list[str], gap: float) -> None:
        super().__init__(keys, gap)
        self.context = context

    def flush(self) -> dict[str, dict[str, Any]]:
        reports = super().flush()
        for key, metadata in reports.items():
            self.context.log_event(dg.AssetMaterialization(asset_key=self.context.asset_key, partition=key,
                                                           metadata=metadata))
        return reports


class _Projections:
    """A tailing run's `Follower` (lake/follow.py), its reports logged as materializations of the tables, kept
    by this run."""

    def __init__(self, context: dg.AssetExecutionContext, warehouse: Location, store_dsn: str | None,
                 domain: Domain, consumer: str, gap: float) -> None:
        self.context = context
        self.follower = None if store_dsn is None else Follower(
            warehouse, domain, lambda: lock_transaction(store_dsn, application_name="es_pipeline tail projections"),
            lambda conn: batch_frontier(conn, consumer), gap)

    def __enter__(self) -> "_Projections":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.follower is not None:
            self.follower.close()

    def maybe_update(self, *, force: bool = False) -> None:
        if self.follower is None:
            return
        try:
            self.follower.update(force=force)
        except Exception as exc:  # noqa: BLE001 - never the extraction's failure: the automation's run reports it
            self.context.log.warning(f"the projections are left to their automation from here: {explain(exc) or exc}")

    def flush(self) -> None:
        if self.follower is not None:
            self._log(self.follower.flush())

    def _log(self, reports: dict[str, dict[str, Any]]) -> None:
        for name, metadata in reports.items():
            self.context.log_event(dg.AssetMaterialization(
                asset_key=dg.AssetKey(name), metadata={**metadata, "kept_by": "the events tailing run"}))


def build_events_job(events: dg.AssetsDefinition) -> UnresolvedAssetJobDefinition:
    """One slice range per run, in process (no step subprocess: seconds of latency per run), without the
    table-wide checks, which run on their own schedule rather than after every increment."""
    return dg.define_asset_job(
        "events_job", selection=dg.AssetSelection.assets(events).without_checks(),
        executor_def=dg.in_process_executor,
        description="Extract one slice range into the Delta `events` table.",
    )
