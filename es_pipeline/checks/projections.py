"""The checks of the projections against `events`, each as of the `events` version the projection folded (its
commits record it): events committed since wait for the next update and are not a failure, so a check compares like
with like and cannot flap.

- `stream_state`: every stream folded up to its last event. Blocking, and part of `snapshots_job`: a failure stops
  the snapshots' write-back, which would otherwise write a state that does not match the events into the store.
  Read with Arrow (no JVM), `events` in bounded pieces, within the engine rule's bound, which the snapshots'
  schedule can afford every ten minutes; on Spark past it.
- `stream_catalog`, `event_type_daily`: every row equal to the aggregate of `events` (lake/aggregates/aggregate.py).
- each cross-stream projection of the team's domain: each key's event count equal to its events in `events`, less
  those waiting (lake/cross_stream.py `reconcile`).

A failure fires EsPipelineProjectionCheckFailed (health/alerts.yml) where Dagster runs them.
"""

from __future__ import annotations

from es_pipeline.checks.check import Check, Given, Outcome
from es_pipeline.domain import Domain
from es_pipeline.lake import cross_stream
from es_pipeline.lake.aggregates.aggregate import Aggregate
from es_pipeline.lake.aggregates.builtin import EVENT_TYPE_DAILY, STREAM_CATALOG
from es_pipeline.lake.delta.definition import Reconciled
from es_pipeline.lake.state.stream_state import versions_off


def stream_state_versions(given: Given) -> Outcome:
    off = versions_off(given.warehouse, given.engine)
    if off.events_version is None:
        return Outcome(True, {"streams_off": 0, "note": "stream_state not built yet"})
    return Outcome(off.streams == 0, {
        "streams_off": off.streams, "examples": ", ".join(off.examples), "events_version_folded": off.events_version,
        "quarantined_streams": off.quarantined,
        **({"read_with": "arrow"} if off.engine == "local" else {}), "engine": off.engine})


def _outcome(r: Reconciled) -> Outcome:
    return Outcome(r.keys_off == 0, r.metadata())


def aggregate_check(aggregate: Aggregate) -> Check:
    return Check(f"{aggregate.name}_matches_events", aggregate.name,
                 f"Every row of {aggregate.name} equals the aggregate of `events` at the version it folded.",
                 lambda given: _outcome(aggregate.reconcile(given.engine, given.warehouse)))


def cross_stream_check(domain: Domain, name: str) -> Check:
    """The check of the team's cross-stream projection `name`: each key's events folded, against `events`."""
    return Check(f"{name}_matches_events", name,
                 f"Each key of {name} folded as many events as `events` holds of its types for it, at the version it "
                 "folded (less those waiting for a lower batch).",
                 lambda given: _outcome(cross_stream.reconcile(given.warehouse, domain, name)))


STREAM_STATE_CHECK = Check(
    "stream_state_version_matches_events", "stream_state",
    "Each stream's folded version equals its max version in `events` (unless events wait, parked, for a gap).",
    stream_state_versions, blocking=True)

CHECKS = [STREAM_STATE_CHECK, aggregate_check(STREAM_CATALOG), aggregate_check(EVENT_TYPE_DAILY)]


def domain_checks(domain: Domain) -> list[Check]:
    """The checks of the domain's own projections (one per cross-stream projection)."""
    return [cross_stream_check(domain, name) for name in sorted(domain.projections)]
