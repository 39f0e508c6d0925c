"""A run asked to stop ends as succeeded or canceled, never as failed: red in the UI means something broke.

SIGINT and SIGTERM reach a run when `make dev` is stopped (Ctrl-C, or TERM from a supervisor), when a deployment
replaces its processes, and when the UI's Terminate is clicked (the run launcher sends SIGINT). Dagster takes
any of them, in an op, for an unexpected end: the run fails with UNEXPECTED_TERMINATION, unless its status was
set to CANCELING first (the UI's Terminate does that).

`stop_requests` installs, for the op's code only (Dagster restores its own handlers after it), a handler that:
- with `finish=True` (an `events` run, whose pass takes seconds): lets the pass in progress end and commit, and
  tells the op to stop (the event it yields), so the run ends as succeeded, nothing half-done; a pass still
  going `GRACE_SECONDS` later (a backlog of many batches, a lock wait) is interrupted as below;
- otherwise (a projection's build may take minutes, more than a shutdown waits): marks the run CANCELING and
  interrupts the op at once, so the run ends as canceled. Whatever the op was writing is abandoned whole: every
  write is a Delta transaction with its transaction id, and the next run goes on from the last commit.
A second signal interrupts at once in both cases.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import dagster as dg
from dagster._core.errors import DagsterExecutionInterruptedError

from es_pipeline.errors import ProjectionFoldError, ReducerError, Retryable, explain

SIGNALS = (signal.SIGINT, signal.SIGTERM)


GRACE_SECONDS = 20.0  # an `events` run asked to stop has this long to end its pass; then it is interrupted


@contextmanager
def stop_requests(context: dg.AssetExecutionContext, *, finish: bool) -> Iterator[threading.Event]:
    """The event set when the run is asked to stop (see the module). Outside the main thread (a thread executor),
    signals are not ours to take: the event is never set and Dagster's handling stays."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    owner = os.getpid()
    watchdog: list[threading.Timer] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner:  # a forked worker of the op (a fold's pool): the default, no storage I/O here
            signal.default_int_handler(signum, frame)
        name = signal.Signals(signum).name
        if finish and not stop.is_set():
            stop.set()
            context.log.info(f"asked to stop ({name}): the pass in progress ends and commits, then the run ends "
                             f"(interrupted if that takes over {GRACE_SECONDS:.0f} s)")
            # One signal is all the launcher's Terminate and run monitoring's time limit send: a pass that hangs
            # (a lock wait, a dead network) must still end. The second signal interrupts.
            watchdog.append(threading.Timer(GRACE_SECONDS, os.kill, args=(owner, signal.SIGTERM)))
            watchdog[-1].daemon = True
            watchdog[-1].start()
            return
        raise DagsterExecutionInterruptedError(f"asked to stop ({name})")

    before = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, on_signal)
    try:
        yield stop
    except DagsterExecutionInterruptedError:
        # Out of the handler, before Dagster sees the interrupt: CANCELING makes it end the run as canceled.
        _mark_canceling(context)
        raise
    finally:
        for timer in watchdog:
            timer.cancel()
        for s, handler in before.items():
            signal.signal(s, handler)


@contextmanager
def projection_run(context: dg.AssetExecutionContext) -> Iterator[None]:
    """The body of a projection's (or the snapshots') run: canceled when asked to stop (`stop_requests`); a reducer
    or a fold that fails on an event fails the run with the stream, version and event type as the failure's
    metadata, which the health exporter and the alert name (docs/operations.md)."""
    with stop_requests(context, finish=False):
        try:
            yield
        except (ReducerError, ProjectionFoldError) as exc:
            raise dg.Failure(description=str(exc), metadata={
                "stream_id": exc.stream_id or "", "version": -1 if exc.version is None else int(exc.version),
                "event_type": exc.event_type or "", "reason": exc.reason}) from None
        except Exception as exc:  # a database, Delta or filesystem failure we can name: one line, no traceback
            known = explain(exc)
            if known is None:
                raise
            raise dg.Failure(description=str(known), allow_retries=isinstance(known, Retryable)) from None


def _mark_canceling(context: dg.AssetExecutionContext) -> None:
    run = context.instance.get_run_by_id(context.run.run_id)
    if run is not None and run.status not in (dg.DagsterRunStatus.CANCELING, dg.DagsterRunStatus.CANCELED):
        context.instance.report_run_canceling(run, message="Asked to stop: canceling; what this run had committed "
                                                           "stays, the rest is left whole to the next run.")
