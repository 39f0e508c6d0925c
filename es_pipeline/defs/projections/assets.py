"""Projections of `events` (catalog, daily counts, current state, typed event tables, a team's cross-stream ones), kept
by declarative automation: every asset from one factory, `projection_asset`."""

import re
from collections.abc import Callable

import dagster as dg

from es_pipeline.defs.resources import EventStoreResource, SparkResource, WarehouseResource
from es_pipeline.defs.stopping import projection_run
from es_pipeline.domain import Domain
from es_pipeline.extraction.offsets import batch_frontier
from es_pipeline.lake.aggregates.aggregate import Aggregate
from es_pipeline.lake.aggregates.builtin import EVENT_TYPE_DAILY, STREAM_CATALOG
from es_pipeline.lake.cross_stream import update as update_cross_stream
from es_pipeline.lake.kernel import runner
from es_pipeline.lake.kernel.projection import Reported
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.lake.typed.event_tables import update as update_event_tables

_AC = dg.AutomationCondition
# A dependency materialized after this table last was (docs/decisions/0046). Within one evaluation (the
# automation's, every 60 s) the later of the two wins, by timestamps; eager() lets the table's own update win,
# whichever came first. A tailing run reports each table its follow kept up to date right after each report
# of `events`, so a follow that failed leaves the table behind that report, and a run comes, even when the
# last follow that worked was reported in the same evaluation.
DEP_UPDATED = _AC.any_deps_match(_AC.newly_updated())  # timed, unlike any_deps_updated() (an OR)
BEHIND = DEP_UPDATED.since(_AC.newly_updated()).with_label("a dependency updated after this table")
# Eager's parts but two: not held back while an `events` run is in progress (a tailing run is, all the time, and
# reports each pass as a materialization; the projections read a committed version of `events` anyway), and
# requested only while behind (or missing), once after each update of a dependency: a run that failed is tried
# again at the next update of `events`, not every evaluation. Both sides of the second "since" are timed too (a
# request by its evaluation's time), so an update after the request, seen in the next evaluation with it, counts.
AFTER_EVENTS = (
    _AC.in_latest_time_window()
    & (_AC.missing() | BEHIND)
    & (_AC.newly_missing().since(_AC.newly_requested())
       | DEP_UPDATED.since(_AC.newly_requested()))
    & ~_AC.any_deps_missing()
    & ~_AC.in_progress()
).with_label("after events: behind a dependency, also while events runs tail")


Update = Callable[[dg.AssetExecutionContext, SparkResource, WarehouseResource, EventStoreResource], Reported]


def projection_asset(name: str, update: Update, *, description: str, kinds: set[str],
                     tags: dict[str, str] | None = None) -> dg.AssetsDefinition:
    """The asset of one table built from `events`, whatever its kind: kept after `events` (`AFTER_EVENTS`), its update
    in a projection run (a stop asked for ends it as succeeded or canceled: defs/stopping.py), the figures of its
    result (lake/kernel/projection.py `Reported`) as its materialization's metadata."""

    @dg.asset(
        name=name,
        description=description,
        deps=["events"],
        kinds=kinds,
        owners=["team:data-engineering"],
        tags={"layer": "projection", **(tags or {})},
        automation_condition=AFTER_EVENTS,
    )
    def asset(context: dg.AssetExecutionContext, spark: SparkResource, warehouse: WarehouseResource,
              event_store: EventStoreResource) -> dg.MaterializeResult:
        with projection_run(context):
            r = update(context, spark, warehouse, event_store)
        return dg.MaterializeResult(metadata=r.metadata())

    return asset


def _aggregate_asset(aggregate: Aggregate, description: str) -> dg.AssetsDefinition:
    """The asset of a built-in aggregate of `events` (lake/aggregates/builtin.py), run by the kernel's runner."""
    return projection_asset(aggregate.name, lambda context, spark, warehouse, event_store: runner.update(
        aggregate, lambda: spark.spark_session, warehouse.root, store_dsn=event_store.dsn, engine=warehouse.engine),
        description=description, kinds={"spark", "delta"})


stream_catalog = _aggregate_asset(STREAM_CATALOG, (
    "One row per stream: type, first and last event time, event count, version. Kept incrementally: each run "
    "merges in only the events that `events` commits added since the last run."))
event_type_daily = _aggregate_asset(EVENT_TYPE_DAILY, (
    "Stream type x event type x day: number of events. Kept incrementally, like stream_catalog."))


def build_stream_state_asset(domain: Domain) -> dg.AssetsDefinition:
    """`stream_state`, folded by `domain`'s reducers (a stream type without one: its rows have no state)."""
    types = ", ".join(sorted(domain.reducers)) or "none"
    return projection_asset("stream_state", lambda context, spark, warehouse, event_store: update_stream_state(
        lambda: spark.spark_session, warehouse.root, domain=domain, store_dsn=event_store.dsn, engine=warehouse.engine,
        rebuilds="hold"),  # in their own job (defs/projections/rebuilds.py)
        kinds={"spark", "delta"},
        description="One row per stream: its current state, folded by the stream type's reducer from `events`, "
        "version, last event time, reducer revision. Incremental: only streams with new events are folded, "
        "from their previous state; a reducer revision bump rebuilds that type alone, beside the live table, swapped in "
        "one commit when caught up (the other types stay fresh meanwhile). A stream type without a "
        f"reducer has rows without state. Domain: {domain.name} (reducers: {types}).")


def tag_value(text: str) -> str:
    """`text` as a Dagster tag value takes it (letters, digits, `_`, `-`, `.`; at most 63): any other character as
    `_`. A domain's name is the team's own (`Domain("my shop")`)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:63] or "_"


def build_cross_stream_asset(domain: Domain, name: str) -> dg.AssetsDefinition:
    """The team's cross-stream projection `name` (lake/cross_stream.py), kept after `events` like the others; a whole
    build on Spark where the warehouse's engine says (ES_PIPELINE_ENGINE)."""
    projection = domain.projections[name]

    def update(context: dg.AssetExecutionContext, spark: SparkResource, warehouse: WarehouseResource,
               event_store: EventStoreResource) -> Reported:
        consumer = event_store.events_source().consumer
        return update_cross_stream(warehouse.root, domain, name, store_dsn=event_store.dsn,
                                   frontier=lambda: batch_frontier(event_store.dsn, consumer),
                                   spark=lambda: spark.spark_session, engine=warehouse.engine)

    return projection_asset(
        name, update, kinds={"python", "delta"}, tags={"domain": tag_value(projection.domain or "none")},
        description=f"Cross-stream projection of domain {projection.domain}: events "
        f"{', '.join(projection.event_types)} from every stream, folded per {projection.key_column} in the lake's "
        "order (batch, position). Incremental: a batch is folded once no lower one can still reach the lake.")


def build_event_tables_asset(domain: Domain) -> dg.AssetsDefinition:
    """The typed event tables (lake/typed/event_tables.py): one per event type, and their mapping `event_tables`; a
    whole build on Spark where the warehouse's engine says (ES_PIPELINE_ENGINE)."""
    return projection_asset("event_tables", lambda context, spark, warehouse, event_store: update_event_tables(
        warehouse.root, domain, store_dsn=event_store.dsn, progress=context.log.info,
        spark=lambda: spark.spark_session, engine=warehouse.engine),
        kinds={"python", "delta"},
        description="A typed table per event type, `events_<type>`: the envelope and one column per payload "
        "field, inferred from the payloads and widened as they change; a value that fits no column is kept in "
        "`_overflow`. The table `event_tables` says which table holds which type and each column's history. "
        "Incremental from `events`' change feed, exactly once (docs/analysts.md).")


def build_projection_assets(domain: Domain) -> list[dg.AssetsDefinition]:
    return [stream_catalog, event_type_daily, build_stream_state_asset(domain), build_event_tables_asset(domain),
            *(build_cross_stream_asset(domain, name) for name in sorted(domain.projections))]


# The built-in projections (a domain's are beside).
NAMES = ("stream_catalog", "event_type_daily", "stream_state", "event_tables")
