"""Work split over one forked process per core, each reading what this process holds without a copy (no I/O).

A fold of a large read (lake/state/whole_fold.py, lake/cross_stream.py) goes faster over every core; the rows
are already in this process's memory, and a forked worker inherits them: `run` sets what is shared, forks,
maps, and clears it. Below `ONE_PROCESS_ROWS` rows a fork costs more than it saves: one share, in this process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any, TypeVar

ONE_PROCESS_ROWS = 200_000  # below, one process: a fork costs more than it saves

T = TypeVar("T")
_SHARED: Any = None  # what `run` shares with its workers (set before the fork, cleared after)


def shares(rows: int) -> int:
    """How many shares a read of `rows` rows is split into: one per core, or one below `ONE_PROCESS_ROWS`."""
    return 1 if rows < ONE_PROCESS_ROWS else (os.cpu_count() or 1)


def shared() -> Any:
    """What `run` shares, in a worker (or in this process while `run` calls `fn` here)."""
    assert _SHARED is not None, "forked.shared() outside forked.run"
    return _SHARED


def run(share: Any, fn: Callable[..., T], *arguments: Iterable[Any]) -> list[T]:
    """`fn` over the zipped `arguments`, one call per forked process (each reading `share` with `shared()`), or
    in this process where there is one call or none."""
    global _SHARED
    calls = list(zip(*arguments, strict=True))
    _SHARED = share
    try:
        if len(calls) <= 1:
            return [fn(*call) for call in calls]
        with ProcessPoolExecutor(max_workers=len(calls), mp_context=get_context("fork")) as pool:
            return list(pool.map(fn, *zip(*calls, strict=True)))
    finally:
        _SHARED = None
