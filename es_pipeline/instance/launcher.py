"""A Dagster run launcher that starts each run as a fork of one warm process (latency).

Dagster's default launcher starts a fresh Python process per run, which imports Dagster and the
code location again: 4-6 s on this 2-core machine, and more when several runs start at once, which
was most of the commit-to-lake latency once `events` runs stopped needing a JVM. This launcher keeps
one worker process (`python -m es_pipeline.instance.launcher`) that has imported all of that once, and
forks it per run: the child executes the run exactly as `dagster api execute_run` would (same
Dagster function, same instance, same events), in well under a second.

- The worker lives as long as the daemon that started it; if it dies it is started again, and if
  it cannot be, the run is launched the default way (nothing is lost, it is only slower).
- Edited code is picked up: before each fork the worker compares the modification times of the
  project's Python files with those it started with, and exits when they changed (a new one starts).
- Each run's pid is kept in a run tag, so `terminate` (UI) can signal it and run monitoring can
  tell a killed run from a running one (`check_run_worker_health`), marking it failed.

Settings: `dagster.yaml` names this class as `run_launcher`. Its config is empty.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from dagster._cli.api import _execute_run_command_body
from dagster._core.instance import DagsterInstance
from dagster._core.launcher import CheckRunHealthResult, DefaultRunLauncher, LaunchRunContext, WorkerStatus
from dagster._core.storage.dagster_run import DagsterRun
from dagster._serdes import deserialize_value, serialize_value
from dagster._utils.interrupts import capture_interrupts

log = logging.getLogger(__name__)

PID_TAG = "es_pipeline/run_pid"
# The process's start time (/proc/<pid>/stat, field 22) beside its pid: a pid the kernel gave to another
# process since is not taken for the run, neither by the health check nor by `terminate`.
PID_START_TAG = "es_pipeline/run_pid_start"
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # es_pipeline/: any edit there makes the worker stale
WORKER_START_TIMEOUT_S = 180.0
# What a run imports, imported once by the worker: Dagster's run machinery and its Postgres storage,
# the code location, and what an `events` run reads and writes with (imported lazily by the code).
WARM_IMPORTS = (
    "dagster._cli.api", "dagster._core.execution.api", "dagster_postgres", "sqlalchemy.dialects.postgresql.psycopg2",
    "es_pipeline.definitions", "es_pipeline.extraction.extractor", "adbc_driver_postgresql.dbapi", "pyarrow.compute", "deltalake",
)


def _code_mtime() -> float:
    return max((p.stat().st_mtime for p in PACKAGE_DIR.rglob("*.py")), default=0.0)


class _Worker:
    """The launcher's side of one warm worker: a subprocess spoken to by JSON lines."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "es_pipeline.instance.launcher"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = _readline(self.proc.stdout, timeout)
        if not line:
            raise RuntimeError(f"the warm run worker exited (code {self.proc.poll()})")
        return dict(json.loads(line))

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()


def _readline(stream: IO[str], timeout: float) -> str:
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        raise TimeoutError(f"the warm run worker did not answer within {timeout:.0f} s")
    return out[0]


class WarmRunLauncher(DefaultRunLauncher):
    """Launches each run as a fork of a warm worker; falls back to Dagster's default launcher."""

    def __init__(self, inst_data: Any = None) -> None:
        super().__init__(inst_data=inst_data)
        self._worker: _Worker | None = None
        self._lock = threading.Lock()

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        try:
            pid = self._fork_run(run)
        except Exception as exc:  # noqa: BLE001 - any trouble: launch the default way, lose nothing
            log.warning("warm launch of run %s failed (%s); launching it the default way", run.run_id, exc)
            super().launch_run(context)
            return
        self._instance.add_run_tags(run.run_id, {PID_TAG: str(pid), PID_START_TAG: process_start(pid) or ""})

    def _fork_run(self, run: DagsterRun) -> int:
        message = {"run_id": run.run_id, "instance_ref": serialize_value(self._instance.get_ref())}
        with self._lock:
            for _ in range(2):  # a stale or dead worker is replaced once
                if self._worker is None or not self._worker.alive():
                    self._worker = _Worker()
                answer = self._worker.request(message, WORKER_START_TIMEOUT_S)
                if "pid" in answer:
                    return int(answer["pid"])
                self._worker = None  # it said its code is stale, and exits
        raise RuntimeError(f"the warm run worker refused the run twice: {answer}")

    def terminate(self, run_id: str) -> bool:
        run = self._instance.get_run_by_id(run_id)
        if run is None or PID_TAG not in run.tags:
            return super().terminate(run_id)
        if run.is_finished:
            return False
        pid = int(run.tags[PID_TAG])
        if not is_same_process(pid, run.tags.get(PID_START_TAG)):
            return False  # gone, and its pid perhaps another process's now: signal nothing
        self._instance.report_run_canceling(run)
        try:
            os.kill(pid, signal.SIGINT)  # Dagster's interrupt handling ends the run
        except ProcessLookupError:
            return False
        return True

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        pid = run.tags.get(PID_TAG)
        if pid is None:
            return CheckRunHealthResult(WorkerStatus.UNKNOWN, "launched the default way: no pid to check")
        if is_same_process(int(pid), run.tags.get(PID_START_TAG)):
            return CheckRunHealthResult(WorkerStatus.RUNNING)
        return CheckRunHealthResult(WorkerStatus.FAILED, f"the run's process (pid {pid}) is gone")

    def dispose(self) -> None:
        if self._worker is not None:
            self._worker.stop()
        super().dispose()


def process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return None
    return fields[19] if len(fields) > 19 else None  # field 22; the list starts at field 3


def is_same_process(pid: int, start: str | None) -> bool:
    """Whether `pid` is alive and, where its start time was recorded, is still the process that started then."""
    if not _alive(pid):
        return False
    return not start or process_start(pid) == start


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the worker process ----------------------------------------------------------------------------


def _run_child(run_id: str, instance_ref: str) -> int:
    """In the forked child: execute the run as `dagster api execute_run` does."""
    with capture_interrupts(), DagsterInstance.from_ref(deserialize_value(instance_ref)) as instance:  # type: ignore[arg-type]
        return int(_execute_run_command_body(run_id, instance, lambda _: None, set_exit_code_on_failure=False))


def worker_main() -> int:
    """Import everything a run needs once, then fork per request read from stdin."""
    for module in WARM_IMPORTS:
        importlib.import_module(module)

    started_mtime = _code_mtime()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    for line in sys.stdin:
        request = json.loads(line)
        if _code_mtime() != started_mtime:
            print(json.dumps({"stale": True}), flush=True)
            return 0
        pid = os.fork()
        if pid == 0:  # the run
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(2, 1)  # the protocol pipe is the parent's alone
            code = 1
            try:
                code = _run_child(request["run_id"], request["instance_ref"])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
