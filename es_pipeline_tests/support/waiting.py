"""Waiting in the tests that drive whole stacks: until a probe answers, or fail saying what was waited for and
what the system was doing meanwhile."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    probe: Callable[[], Any], seconds: float, what: str, *, every: float = 0.5,
    doing: Callable[[], str] | None = None,
) -> Any:
    """`probe()`'s first truthy answer within `seconds`, asked every `every` seconds; else an AssertionError
    naming `what`, and what `doing()` says the system was doing (a probe that raised says so too)."""
    began = time.monotonic()
    deadline = began + seconds
    raised: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            found = probe()
        except Exception as exc:  # noqa: BLE001 - a stack restarting answers with errors for a while; told below
            raised, found = exc, None
        if found:
            return found
        time.sleep(every)
    message = f"waited {seconds:.0f} s for {what}"
    if raised is not None:
        message += f"\nthe probe last raised: {raised!r}"
    if doing is not None:
        try:
            message += "\nmeanwhile:\n" + doing()
        except Exception as exc:  # noqa: BLE001 - the diagnosis must not hide the failure
            message += f"\n(could not say what the system was doing: {exc!r})"
    raise AssertionError(message)
