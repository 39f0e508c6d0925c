"""The checks of the lake: each table against what it is built from, declared once and run anywhere.

- `check`: what a check is (`Check`), what it is given (`Given`), what it finds (`Outcome`).
- `events`: `events` against the store (no duplicates, contiguous versions, counts below the watermarks).
- `projections`: every projection against `events` at the version it folded.
- `snapshots`: the store's snapshot table against the lake's.
- `catalog`: the catalog's tables against the lake's.

`every_check(domain)` lists them all, the team's cross-stream projections' too; `run` runs a selection, one at a
time, with what to say as each ends. `es-pipeline lake check [TABLE...]` runs them without Dagster; the code location
wraps each as a Dagster asset check of the same name (defs/checks.py). Above `extraction` (the reconcile reads the
offsets) and `lake`; below Dagster, which it never imports.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from es_pipeline.checks import catalog, events, projections, snapshots
from es_pipeline.checks.check import Check, Given, Outcome
from es_pipeline.domain import Domain

__all__ = ["BUILTIN", "Check", "Given", "Outcome", "every_check", "run", "select"]

BUILTIN: list[Check] = [*events.CHECKS, *projections.CHECKS, *snapshots.CHECKS, *catalog.CHECKS]


def every_check(domain: Domain) -> list[Check]:
    """Every check of a lake folding `domain`: the built-in tables', then one per cross-stream projection."""
    return [*BUILTIN, *projections.domain_checks(domain)]


def select(checks: list[Check], tables: Iterable[str]) -> list[Check]:
    """The checks of `tables` (all where none is named); a table no check knows: ValueError naming those known."""
    wanted = list(dict.fromkeys(tables))
    known = list(dict.fromkeys(c.table for c in checks))
    unknown = [t for t in wanted if t not in known]
    if unknown:
        raise ValueError(f"no check of {', '.join(unknown)}: the tables checked are {', '.join(known)}")
    return [c for c in checks if not wanted or c.table in wanted]


def run(checks: list[Check], given: Given, say: Callable[[Check, Outcome | Exception, float], None] | None = None,
        ) -> dict[str, Outcome | Exception]:
    """Each of `checks`, in order; one that raises is reported with its error and the others still run."""
    found: dict[str, Outcome | Exception] = {}
    for check in checks:
        started = time.monotonic()
        try:
            outcome: Outcome | Exception = check.run(given)
        except Exception as exc:  # noqa: BLE001 - reported as the check's failure; the next check still runs
            outcome = exc
        found[check.name] = outcome
        if say is not None:
            say(check, outcome, time.monotonic() - started)
    return found
