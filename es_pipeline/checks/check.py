"""What a check of the lake is: its declaration (`Check`), what it is given (`Given`), what it says (`Outcome`).

A check is declared once, here in the library: its name, the table it checks, what it asserts, whether a failure
blocks what follows, and the function that runs it. `es-pipeline lake check` runs the declarations as they are;
the code location wraps each as a Dagster asset check of the same name (defs/checks.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from es_pipeline.extraction.slices import SliceRange
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.read.metastore import Metastore
from es_pipeline.source.mapping import Source
from es_pipeline.store.event_store import EventStore


@dataclass(frozen=True)
class Given:
    """What a check reads: the lake (`warehouse`), where its work runs (`engine`, the engine rule), the store
    (`store_dsn`, read as `source`), the catalog (`metastore`), and `scope`: the slices of the one partition it runs beside (None: every
    slice; only the checks of `events` narrow to it)."""

    engine: Engine
    warehouse: Location
    store_dsn: str
    source: Source
    scope: SliceRange | None = None
    metastore: Metastore | None = None  # the catalog (lake/read/metastore.py); None: ES_PIPELINE_METASTORE_DSN=off

    def store(self) -> EventStore:
        return EventStore.for_source(self.store_dsn, self.source)


@dataclass(frozen=True)
class Outcome:
    """What a check found: passed or not, and its figures (plain values: counts, a few examples, the engine)."""

    passed: bool
    metadata: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        """One line: the figures that say what was found (examples last)."""
        shown = [f"{k} {v}" for k, v in self.metadata.items() if k != "examples" and v not in ("", "-", None)]
        examples = self.metadata.get("examples")
        return ", ".join(shown + ([f"e.g. {examples}"] if examples and examples != "-" else []))


@dataclass(frozen=True)
class Check:
    """One check of one table: `run` it with what it is `Given`.

    `blocking`: in Dagster, a failure stops the steps after it (the snapshots' write-back waits on stream_state's).
    `scoped`: it checks only `Given.scope`'s slices when run beside one partition of `events`.
    """

    name: str
    table: str
    description: str
    run: Callable[[Given], Outcome]
    blocking: bool = False
    scoped: bool = False
