"""Every table a domain builds from `events`, as plug-ins, in the order a follow takes them (lake/follow.py):
`stream_state` (with its typed state and history tables), the built-in aggregates, the domain's cross-stream
projections, then the typed event tables. Each plug-in names its table (and turn), the columns of `events` its
increment reads, and its increment in its turn: the kernel's runner for the kinds that have moved onto it
(decision 0049), the kind's own for the others until they do.

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
from es_pipeline.lake.kernel.feed import Feed
from es_pipeline.lake.kernel.projection import Reported
from es_pipeline.lake.kernel.turn import Turn
from es_pipeline.lake.state.fold import read_columns
from es_pipeline.lake.state.stream_state import small_increment, with_typed_state
from es_pipeline.lake.typed import event_tables

Increments = Callable[[Location, Turn, Feed, "Frontier | None"], "Reported | None"]


@dataclass(frozen=True)
class Plugin:
    name: str  # the table, and the turn its updates take
    columns: tuple[str, ...]  # the columns of `events` its increment reads from the shared feed
    increment: Increments  # its increment in its turn; None: not one to do in a follow (a whole build, Spark)


def of(domain: Domain) -> list[Plugin]:
    """The plug-ins of every table `domain` builds from `events`, in the order a follow takes them."""
    plugins = [_stream_state(domain), _aggregate(STREAM_CATALOG), _aggregate(EVENT_TYPE_DAILY)]
    plugins += [_cross_stream(domain, name) for name in sorted(domain.projections)]
    plugins.append(Plugin(event_tables.NAME, (), lambda warehouse, turn, feed, frontier: event_tables.increment(
        warehouse, domain, turn, feed)))  # from its own reads of the feed, a window at a time
    return plugins


def _stream_state(domain: Domain) -> Plugin:
    def increment(warehouse: Location, turn: Turn, events_feed: Feed, frontier: Frontier | None) -> Reported | None:
        state = small_increment(warehouse, domain, False, turn, events_feed)
        return None if state is None else with_typed_state(warehouse, domain, state)

    return Plugin("stream_state", tuple(read_columns(domain)), increment)


def _aggregate(aggregate: Aggregate) -> Plugin:
    return Plugin(aggregate.name, aggregate.columns, lambda warehouse, turn, events_feed, frontier: runner.increment(
        aggregate, warehouse, turn, events_feed))


def _cross_stream(domain: Domain, name: str) -> Plugin:
    projection = domain.projections[name]
    return Plugin(name, tuple(cross_stream.columns_of(domain)), lambda warehouse, turn, events_feed, frontier:
                  cross_stream.increment(warehouse, projection, domain, turn, frontier, events_feed))
