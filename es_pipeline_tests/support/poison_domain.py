"""A domain whose reducer fails on one event type, for the health drills: `ES_PIPELINE_DOMAIN=
es_pipeline_tests.support.poison_domain` makes `stream_state` fail on the stream that carries a `Poisoned` event,
the way a team's reducer fails on an event it did not expect."""

from __future__ import annotations

from es_pipeline.domain import Domain, Event, State

domain = Domain("drill")


@domain.reducer("drill", revision=1)
def drill(state: State, event: Event) -> State:
    if event.event_type == "Poisoned":
        raise ValueError(f"this reducer cannot fold {event.event_type}")
    return {"events": int(state.get("events", 0)) + 1}
