"""es_pipeline: an event-sourced PostgreSQL store, extracted exactly once into Delta Lake tables, with projections.

What a team imports is here, and only here (`__all__`; es_pipeline_tests/test_public_api.py holds it):

- its domain: `Domain` (reducers, upcasters, typed states, cross-stream projections, typed event tables), `Event`,
  `State`, `UnknownEventType` (docs/domain.md);
- its writers: `EventStore`, `NewEvent`, `NO_STREAM`, and the errors an append raises, `ConcurrencyError` and
  `InvalidAppend` (docs/writing.md); every error es_pipeline raises is an `EsPipelineError`;
- its code location: `EsPipeline`, the Dagster component (`dg scaffold defs es_pipeline.component.EsPipeline`), and
  `build_definitions` for a code location written in Python; both import Dagster, so they load when first named.

Every other module is es_pipeline's own and may change between versions (CHANGELOG.md says what changed).
"""

from __future__ import annotations

from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

from es_pipeline.domain import Domain, Event, State, UnknownEventType
from es_pipeline.errors import ConcurrencyError, EsPipelineError, InvalidAppend
from es_pipeline.store.event_store import NO_STREAM, EventStore, NewEvent

if TYPE_CHECKING:
    from es_pipeline.component import EsPipeline
    from es_pipeline.location import build_definitions

try:
    __version__ = _metadata.version("es_pipeline")
except _metadata.PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

__all__ = [
    "NO_STREAM",
    "ConcurrencyError",
    "Domain",
    "EsPipeline",
    "EsPipelineError",
    "Event",
    "EventStore",
    "InvalidAppend",
    "NewEvent",
    "State",
    "UnknownEventType",
    "__version__",
    "build_definitions",
]

_DAGSTER_SIDE = {"EsPipeline": "es_pipeline.component", "build_definitions": "es_pipeline.location"}


def __getattr__(name: str) -> Any:
    """`EsPipeline` and `build_definitions` import Dagster: loaded when first named, so that a writer importing
    `EventStore` does not pay for Dagster."""
    if name in _DAGSTER_SIDE:
        import importlib

        return getattr(importlib.import_module(_DAGSTER_SIDE[name]), name)
    raise AttributeError(f"module 'es_pipeline' has no attribute {name!r}")
