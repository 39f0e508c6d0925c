"""Stand-ins handed to es_pipeline in a test: an extractor step hook (`on_step`) that crashes or holds at a
step, and a Spark getter that fails if it is ever called."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from es_pipeline.extraction.offsets import Batch

StepHook = Callable[[str, Batch | None], None]


class Crash(Exception):
    """Stands for the process dying at a step: nothing after it runs."""


def crash_at(step: str, nth: int = 1) -> StepHook:
    """An `on_step` hook that raises `Crash` the `nth` time the extractor reaches `step`."""
    seen = [0]

    def hook(name: str, batch: Batch | None) -> None:
        if name == step:
            seen[0] += 1
            if seen[0] == nth:
                raise Crash(step)

    return hook


def hold_when_locked(holding: threading.Event, release: threading.Event) -> StepHook:
    """An `on_step` hook that, once the run holds its slice locks, sets `holding` and waits (60 s) for `release`."""

    def hold(name: str, batch: Batch | None) -> None:
        if name == "locked":
            holding.set()
            release.wait(60)

    return hold


def no_spark() -> Any:
    """A Spark getter for code that must not start Spark: asking it for a session fails the test."""
    raise AssertionError("asked for a Spark session, but nothing here needs one")
