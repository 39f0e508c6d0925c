"""Waiting in the tests that drive whole stacks: until a probe answers, or fail saying what was waited for and
what the system was doing meanwhile."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
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


def stack_doing(instance: Any, logs: Path, prom: Any = None) -> Callable[[], str]:
    """What a Dagster stack (es_pipeline/dev/stack.py) is doing, for a wait's failure message: the machine's load,
    the newest runs, the daemon's last lines; with `prom` (a Prometheus of es_pipeline/health/prometheus.py), the
    alerts, the failing assets the exporter reads and the parts it cannot read."""
    def say() -> str:
        now = time.time()
        lines = [f"load average {os.getloadavg()[0]:.1f}"]
        for r in instance.get_run_records(limit=12):
            run = r.dagster_run
            assets = ",".join(sorted(k.to_user_string() for k in run.asset_selection or ()))
            ended = f", ended {now - r.end_time:.0f} s ago" if r.end_time else ""
            lines.append(f"run {run.run_id[:8]} {run.job_name} [{assets}] {run.status.value}, "
                         f"created {now - r.create_timestamp.timestamp():.0f} s ago{ended}")
        if prom is not None:
            lines.append(f"alerts: {[(a['labels']['alertname'], a['state']) for a in prom.alerts()]}")
            lines.append(f"failing assets read: {[m['metric'] for m in prom.query('es_pipeline_asset_failing == 1')]}")
            lines.append(f"parts unread: {[m['metric'] for m in prom.query('es_pipeline_reading_ok == 0')]}")
        daemon = (logs / "daemon.log").read_text(errors="replace").splitlines()[-12:] \
            if (logs / "daemon.log").exists() else []
        return "\n".join(["  " + line for line in lines] + ["  daemon.log: " + line for line in daemon])
    return say
