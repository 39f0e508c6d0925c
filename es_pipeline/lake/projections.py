"""Every table a domain builds from `events`, as plug-ins, in the order a follow takes them (lake/follow.py):
`stream_state` (with its typed state and history tables), the built-in aggregates, the domain's cross-stream
projections, then the typed event tables. Each plug-in names its table (and turn), the columns of `events` its
increment reads, its increment in its turn (the kernel's runner: lake/kernel/runner.py), its whole update (what its
asset runs: defs/projections/assets.py builds every asset from this list), and how its asset describes it.

An increment here never builds a table whole and never starts Spark: it returns None instead, and the table's
own run (its asset) does that work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from es_pipeline.domain import Domain
from es_pipeline.lake import cross_stream
from es_pipeline.lake.aggregates.aggregate import Aggregate
from es_pipeline.lake.aggregates.builtin import EVENT_TYPE_DAILY, STREAM_CATALOG
from es_pipeline.lake.cross_stream import Frontier
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.kernel import runner
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.kernel.feed import Feed
from es_pipeline.lake.kernel.result import Result
from es_pipeline.lake.kernel.turn import Turn
from es_pipeline.lake.state.fold import read_columns
from es_pipeline.lake.state.stream_state import small_increment, update_stream_state
from es_pipeline.lake.typed import event_tables

Increments = Callable[[Location, Turn, Feed, "Frontier | None"], "Result | None"]


@dataclass(frozen=True)
class Run:
    """What a table's whole update is given by the run that asks for it (its asset's)."""

    warehouse: Location
    engine: Engine  # where its work runs (ES_PIPELINE_ENGINE, and the Spark session where the rule says Spark)
    store_dsn: str | None  # the store, for the table's turn
    frontier: Frontier | None = None  # the store's batch frontier (cross-stream projections)
    progress: Callable[[str], None] | None = None  # where a long update says how far it got


@dataclass(frozen=True)
class Plugin:
    name: str  # the table, and the turn its updates take
    columns: tuple[str, ...]  # the columns of `events` its increment reads from the shared feed
    increment: Increments  # its increment in its turn; None: not one to do in a follow (a whole build, Spark)
    update: Callable[[Run], Result]  # its whole update: an increment, a whole build, on Spark where the rule says
    description: str  # what its asset says of it
    kinds: frozenset[str] = frozenset({"python", "delta"})  # what builds it, as its asset shows
    tags: tuple[tuple[str, str], ...] = ()  # its asset's tags beside the projections' own
    reads_frontier: bool = False  # its update is given the store's batch frontier (`Run.frontier`)


def of(domain: Domain) -> list[Plugin]:
    """The plug-ins of every table `domain` builds from `events`, in the order a follow takes them."""
    plugins = [_stream_state(domain), _aggregate(STREAM_CATALOG, _CATALOG), _aggregate(EVENT_TYPE_DAILY, _DAILY)]
    plugins += [_cross_stream(domain, name) for name in sorted(domain.projections)]
    plugins.append(_event_tables(domain))
    return plugins


_CATALOG = ("One row per stream: type, first and last event time, event count, version. Kept incrementally: each run "
            "merges in only the events that `events` commits added since the last run.")
_DAILY = "Stream type x event type x day: number of events. Kept incrementally, like stream_catalog."


def _stream_state(domain: Domain) -> Plugin:
    def increment(warehouse: Location, turn: Turn, events_feed: Feed, frontier: Frontier | None) -> Result | None:
        return small_increment(warehouse, domain, False, turn, events_feed)

    types = ", ".join(sorted(domain.reducers)) or "none"
    return Plugin("stream_state", tuple(read_columns(domain)), increment, lambda run: update_stream_state(
        run.engine, run.warehouse, domain=domain, store_dsn=run.store_dsn,
        rebuilds="hold"),  # in their own job (defs/projections/rebuilds.py)
        "One row per stream: its current state, folded by the stream type's reducer from `events`, "
        "version, last event time, reducer revision. Incremental: only streams with new events are folded, "
        "from their previous state; a reducer revision bump rebuilds that type alone, beside the live table, swapped "
        "in one commit when caught up (the other types stay fresh meanwhile). A stream type without a "
        f"reducer has rows without state. Domain: {domain.name} (reducers: {types}).", frozenset({"spark", "delta"}))


def _aggregate(aggregate: Aggregate, description: str) -> Plugin:
    return Plugin(aggregate.name, aggregate.columns, lambda warehouse, turn, events_feed, frontier: runner.increment(
        aggregate, warehouse, turn, events_feed), lambda run: runner.update(
        aggregate, run.engine, run.warehouse, store_dsn=run.store_dsn),
        description, frozenset({"spark", "delta"}))


def _cross_stream(domain: Domain, name: str) -> Plugin:
    projection = domain.projections[name]
    return Plugin(name, tuple(cross_stream.columns_of(domain)), lambda warehouse, turn, events_feed, frontier:
                  cross_stream.increment(warehouse, projection, domain, turn, frontier, events_feed),
                  lambda run: cross_stream.update(run.warehouse, domain, name, store_dsn=run.store_dsn,
                                                  frontier=run.frontier, engine=run.engine),
                  f"Cross-stream projection of domain {projection.domain}: events "
                  f"{', '.join(projection.event_types)} from every stream, folded per {projection.key_column} in the "
                  "lake's order (batch, position). Incremental: a batch is folded once no lower one can still reach "
                  "the lake.", tags=(("domain", projection.domain or "none"),), reads_frontier=True)


def _event_tables(domain: Domain) -> Plugin:
    return Plugin(event_tables.NAME, (), lambda warehouse, turn, feed, frontier: event_tables.increment(
        warehouse, domain, turn, feed),  # from its own reads of the feed, a window at a time
        lambda run: event_tables.update(run.warehouse, domain, store_dsn=run.store_dsn, progress=run.progress,
                                        engine=run.engine),
        "A typed table per event type, `events_<type>`: the envelope and one column per payload "
        "field, inferred from the payloads and widened as they change; a value that fits no column is kept in "
        "`_overflow`. The table `event_tables` says which table holds which type and each column's history. "
        "Incremental from `events`' change feed, exactly once (docs/analysts.md).")
