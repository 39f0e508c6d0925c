"""Waiting in the tests that drive whole stacks: until a probe answers, or fail saying what was waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(probe: Callable[[], Any], seconds: float, what: str, *, every: float = 0.5) -> Any:
    """`probe()`'s first truthy answer within `seconds`, asked every `every` seconds; else an AssertionError
    naming `what`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"waited {seconds:.0f} s for {what}")
