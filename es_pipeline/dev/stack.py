"""The whole stack as separate processes: a Dagster daemon over Postgres storage and its code server, a
Spark Connect server.

Used by the end-to-end test and the latency benchmark: everything runs as separate processes,
as `make dev` runs them.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from es_pipeline.dev.connect_token import TOKEN_ENV, local_remote, local_token
from es_pipeline.settings import PROJECT_ROOT, dagster_storage_url

VENV_BIN = Path(sys.executable).parent


# Ports handed out by free_port, one claim file each, for every process of this machine: between choosing a
# port and a server binding it, another process (a parallel test tier) must not be handed the same one.
PORT_CLAIMS = Path(tempfile.gettempdir()) / "es_pipeline-ports"
PORT_RANGE = (20_000, 32_768)  # below Linux's ephemeral range: no client connection's own port is taken
CLAIM_SECONDS = 600.0  # a claim older than this is over: its server is listening by then, or gone


def free_port() -> int:
    """A port of 127.0.0.1 nothing listens on and no other caller on this machine was handed in the last
    CLAIM_SECONDS (the claim is a file in PORT_CLAIMS, made with O_EXCL)."""
    if not PORT_CLAIMS.is_dir():
        PORT_CLAIMS.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):  # shared by every user's runs, as /tmp is (umask left aside)
            PORT_CLAIMS.chmod(0o1777)
    for _ in range(1_000):
        port = random.randrange(*PORT_RANGE)
        claim = PORT_CLAIMS / str(port)
        try:
            if time.time() - claim.stat().st_mtime < CLAIM_SECONDS:
                continue
            claim.unlink(missing_ok=True)  # an old claim: over
        except FileNotFoundError:
            pass
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            continue  # another process claimed it between our look and now
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE[0]}..{PORT_RANGE[1]} after 1,000 tries (claims in {PORT_CLAIMS})")


@dataclass
class Stack:
    env: dict[str, str]
    dagster_home: Path
    warehouse: Path
    processes: list[subprocess.Popen[bytes]]


def stop_process(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not ended within `timeout` seconds; reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listens on port {port} after {timeout:.0f} s")


@contextmanager
def dagster_stack(
    *, admin_dsn: str, dsn: str, tmp: Path, slice_ranges: int = 2, sensor_interval: int | None = 2, connect: bool = True,
    automation: bool = False, max_runtime_seconds: int | None = None, extra_env: dict[str, str] | None = None,
) -> Iterator[Stack]:
    """Dagster daemon (sensor on, run queue with tag limits) with its storage in a fresh database.

    `max_runtime_seconds` replaces dagster.yaml's run-monitoring limit (6 h) for this instance.
    """
    storage_db = f"dagster_e2e_{os.getpid()}_{int(time.time())}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{storage_db}"')
    admin = conninfo_to_dict(admin_dsn)
    home = tmp / "dagster_home"
    home.mkdir()
    instance_yaml = (PROJECT_ROOT / "dagster.yaml").read_text()
    if max_runtime_seconds is not None:
        instance_yaml = re.sub(r"max_runtime_seconds: \d+", f"max_runtime_seconds: {max_runtime_seconds}", instance_yaml)
    (home / "dagster.yaml").write_text(instance_yaml)
    warehouse = tmp / "warehouse"
    env = dict(os.environ)
    env.update({
        "DAGSTER_HOME": str(home),
        "DAGSTER_PG_URL": dagster_storage_url(str(admin["user"]), str(admin["host"]), str(admin["port"]), storage_db,
                                              str(admin["passfile"]) if admin.get("passfile") else None),
        "ES_PIPELINE_PG_DSN": dsn,
        "ES_PIPELINE_WAREHOUSE": str(warehouse),
        "ES_PIPELINE_SLICE_RANGES": str(slice_ranges),
        "ES_PIPELINE_SPARK_MASTER": "local[2]",
        "ES_PIPELINE_AUTOMATION": "on" if automation else "off",
        # One pass per run unless asked (extra_env): the loop its callers test is the sensor's run per range.
        "ES_PIPELINE_TAIL_SECONDS": "0",
        "PYSPARK_PYTHON": sys.executable,
    })
    if sensor_interval is not None:  # else the default (es_pipeline/settings.py), as make dev has it
        env["ES_PIPELINE_SENSOR_INTERVAL"] = str(sensor_interval)
    env.update(extra_env or {})
    procs: list[subprocess.Popen[bytes]] = []
    logs = tmp / "logs"
    logs.mkdir()
    try:
        if connect:
            port = free_port()
            env["ES_PIPELINE_SPARK_REMOTE"] = local_remote(port)
            env[TOKEN_ENV] = local_token()
            procs.append(subprocess.Popen(
                [str(VENV_BIN / "es-pipeline"), "spark", "serve", "--port", str(port)], env=env,
                stdout=open(logs / "connect.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
            ))
            wait_port(port, 120)
        # One code server for the stack, as docs/deploy.md runs it: a daemon given workspace.yaml itself would
        # start its own and replace it every minute (a fresh interpreter importing the code each time). The server
        # itself (`dagster api grpc`), not `dagster code-server start`, which is a proxy in front of a server it
        # restarts on reload: a second process relaying every call and pinging its child every second, which
        # cost as much CPU as the server (docs/decisions/0045).
        code_port = free_port()
        procs.append(subprocess.Popen(
            [str(VENV_BIN / "dagster"), "api", "grpc", "-m", "es_pipeline.definitions", "-a", "defs",
             "--location-name", "es_pipeline", "-h", "127.0.0.1", "-p", str(code_port), "--log-level", "warning"],
            env=env, cwd=PROJECT_ROOT, stdout=open(logs / "code-server.log", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        ))
        workspace = tmp / "workspace.yaml"
        workspace.write_text("load_from:\n  - grpc_server:\n      host: 127.0.0.1\n"
                             f"      port: {code_port}\n      location_name: es_pipeline\n")
        wait_port(code_port, 120)
        procs.append(subprocess.Popen(
            [str(VENV_BIN / "dagster-daemon"), "run", "-w", str(workspace)],
            env=env, cwd=PROJECT_ROOT, stdout=open(logs / "daemon.log", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        ))
        yield Stack(env, home, warehouse, procs)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{storage_db}" WITH (FORCE)')


def run_pid(instance: Any, run_id: str) -> int | None:
    """The pid of a run's worker process, as its own events record it."""
    for entry in instance.all_logs(run_id):
        if entry.dagster_event is not None and entry.dagster_event.pid:
            return int(entry.dagster_event.pid)
    return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
