"""Projections of `events` (catalog, daily counts, current state, typed event tables, a team's cross-stream ones), kept
by declarative automation: every asset from one factory, `projection_asset`, over the domain's plug-ins
(lake/projections.py `of`)."""

import re
from collections.abc import Callable

import dagster as dg

from es_pipeline.defs.resources import EventStoreResource, SparkResource, WarehouseResource, engine_of
from es_pipeline.defs.stopping import projection_run
from es_pipeline.domain import Domain
from es_pipeline.extraction.offsets import batch_frontier
from es_pipeline.lake import projections
from es_pipeline.lake.kernel.result import Result
from es_pipeline.lake.projections import Plugin

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


Update = Callable[[dg.AssetExecutionContext, SparkResource, WarehouseResource, EventStoreResource], Result]


def projection_asset(name: str, update: Update, *, description: str, kinds: set[str],
                     tags: dict[str, str] | None = None) -> dg.AssetsDefinition:
    """The asset of one table built from `events`, whatever its kind: kept after `events` (`AFTER_EVENTS`), its update
    in a projection run (a stop asked for ends it as succeeded or canceled: defs/stopping.py), the figures of its
    result (lake/kernel/result.py `Result`) as its materialization's metadata."""

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


def tag_value(text: str) -> str:
    """`text` as a Dagster tag value takes it (letters, digits, `_`, `-`, `.`; at most 63): any other character as
    `_`. A domain's name is the team's own (`Domain("my shop")`)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:63] or "_"


def plugin_asset(plugin: Plugin) -> dg.AssetsDefinition:
    """The asset of one plug-in of lake/projections.py: its whole update, given the run's resources."""

    def update(context: dg.AssetExecutionContext, spark: SparkResource, warehouse: WarehouseResource,
               event_store: EventStoreResource) -> Result:
        consumer = event_store.events_source().consumer if plugin.reads_frontier else None
        return plugin.update(projections.Run(
            warehouse.root, engine_of(warehouse, spark), event_store.dsn,
            frontier=None if consumer is None else lambda: batch_frontier(event_store.dsn, consumer),
            progress=context.log.info))

    return projection_asset(plugin.name, update, description=plugin.description, kinds=set(plugin.kinds),
                            tags={k: tag_value(v) for k, v in plugin.tags})


def build_projection_assets(domain: Domain) -> list[dg.AssetsDefinition]:
    """The asset of every table `domain` builds from `events` (lake/projections.py), from one factory."""
    return [plugin_asset(plugin) for plugin in projections.of(domain)]


def _plugin(domain: Domain, name: str) -> Plugin:
    return next(p for p in projections.of(domain) if p.name == name)


def build_stream_state_asset(domain: Domain) -> dg.AssetsDefinition:
    """`stream_state`'s asset alone (tests and a team's own definitions)."""
    return plugin_asset(_plugin(domain, "stream_state"))


def build_cross_stream_asset(domain: Domain, name: str) -> dg.AssetsDefinition:
    """Cross-stream projection `name`'s asset alone."""
    return plugin_asset(_plugin(domain, name))


def build_event_tables_asset(domain: Domain) -> dg.AssetsDefinition:
    """The typed event tables' asset alone."""
    return plugin_asset(_plugin(domain, "event_tables"))


# The built-in projections (a domain's are beside).
NAMES = ("stream_catalog", "event_type_daily", "stream_state", "event_tables")
