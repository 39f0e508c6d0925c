"""Work split over one forked process per core, each reading what this process holds without a copy (no I/O).

A fold of a large read (lake/state/whole_fold.py, lake/cross_stream.py) goes faster over every core; the rows
are already in this process's memory, and a forked worker inherits them: `run` sets what is shared, forks,
maps, and clears it. Below `ONE_PROCESS_ROWS` rows a fork costs more than it saves: one share, in this process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing import get_context
from typing import Any, TypeVar

ONE_PROCESS_ROWS = 200_000  # below, one process: a fork costs more than it saves

T = TypeVar("T")
_SHARED: Any = None  # what `run` shares with its workers (set before the fork, cleared after)
_BACKGROUND = False  # workers in a scheduling group of their own at the lowest priority, within `background`


def shares(rows: int) -> int:
    """How many shares a read of `rows` rows is split into: one per core, or one below `ONE_PROCESS_ROWS`."""
    return 1 if rows < ONE_PROCESS_ROWS else (os.cpu_count() or 1)


@contextmanager
def background() -> Iterator[None]:
    """Within the block, `run`'s workers each in a session, so a scheduling group (Linux's autogroup), of their own at
    the lowest priority (`in_background`): work that must leave the cores to the live work (lake/state/rebuild.py)."""
    global _BACKGROUND
    was, _BACKGROUND = _BACKGROUND, True
    try:
        yield
    finally:
        _BACKGROUND = was


def in_background() -> None:
    """This process in a session of its own, its scheduling group at niceness 19 (where Linux groups by session,
    `kernel.sched_autogroup_enabled`, a process's niceness only ranks it within its session: the database server and
    the other sessions' processes share the cores with the session as a whole, however nice its work)."""
    try:
        os.setsid()
    except OSError:  # a process group leader already
        pass
    try:
        with open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write("19")
    except OSError:  # no autogroup here: the niceness inherited is what there is
        pass


def shared() -> Any:
    """What `run` shares, in a worker (or in this process while `run` calls `fn` here)."""
    assert _SHARED is not None, "forked.shared() outside forked.run"
    return _SHARED


def run(share: Any, fn: Callable[..., T], *arguments: Iterable[Any]) -> list[T]:
    """`fn` over the zipped `arguments`, in forked processes (each reading `share` with `shared()`; one per core at
    most, each taking the next call when done), or in this process where there is one call or none."""
    global _SHARED
    calls = list(zip(*arguments, strict=True))
    _SHARED = share
    try:
        if len(calls) <= 1:
            return [fn(*call) for call in calls]
        _py4j_kept_at_fork()
        with ProcessPoolExecutor(max_workers=min(len(calls), os.cpu_count() or 1), mp_context=get_context("fork"),
                                 initializer=in_background if _BACKGROUND else None) as pool:
            return list(pool.map(fn, *zip(*calls, strict=True)))
    finally:
        _SHARED = None


_FORKER = 0  # the process that forks the workers: the one whose Py4J connections they are


def _py4j_kept_at_fork() -> None:
    """Keep this process's Py4J connections to Spark's JVM whole through the fork. A forked worker drops the
    thread-local connections of the threads the fork did not copy, and Py4J closes each, shutting its TCP
    connection down: the same connection as the parent's, which the JVM then resets under it ("Connection reset
    by peer"). Py4J's `quiet_shutdown` is made to shut down only in the process that forks (a worker closes its
    copy of the socket, which leaves the parent's open)."""
    global _FORKER
    _FORKER = os.getpid()
    module = sys.modules.get("py4j.clientserver")
    if module is None or getattr(module.quiet_shutdown, "_keeps_forks", False):
        return
    original = module.quiet_shutdown

    def quiet_shutdown(socket: Any) -> None:
        if os.getpid() == _FORKER:
            original(socket)

    quiet_shutdown._keeps_forks = True  # type: ignore[attr-defined]
    module.quiet_shutdown = quiet_shutdown  # type: ignore[attr-defined]
