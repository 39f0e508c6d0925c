"""The project's own local PostgreSQL server: Debian's binaries, run as the `postgres` user.

Data lives in `.pgdata/` (git-ignored), the server listens on 127.0.0.1, port `ES_PIPELINE_LOCAL_PG_PORT`
(default 54329), with trust auth.
It is a development server only; point ES_PIPELINE_PG_DSN elsewhere for anything real.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import time
from pathlib import Path

from es_pipeline.errors import LocalServerError
from es_pipeline.settings import LOCAL_DAGSTER_DATABASE, LOCAL_PG_DATABASE, PROJECT_ROOT, Settings

PGDATA = PROJECT_ROOT / ".pgdata" / "data"
PGLOG = PROJECT_ROOT / ".pgdata" / "server.log"

SERVER_SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "unix_socket_directories": "'/tmp'",
    "max_connections": "200",
    "max_prepared_transactions": "20",
    "shared_buffers": "512MB",
    "work_mem": "32MB",
    "maintenance_work_mem": "256MB",
    "max_wal_size": "4GB",
    "checkpoint_timeout": "15min",
    "log_min_messages": "warning",
    # Lets tests and `status` see the real commit order (it differs from tx_id order).
    "track_commit_timestamp": "on",
}


def bindir() -> Path:
    """Where the server binaries (initdb, postgres, pg_ctl) are: `ES_PIPELINE_PG_BINDIR`, else
    pg_config's answer, else the newest Debian version."""
    for c in _candidates():
        if (c / "postgres").exists() and (c / "initdb").exists():
            return c
    raise LocalServerError(
        "no PostgreSQL server binaries found (initdb, postgres). Install them with "
        "`apt-get update && apt-get install -y postgresql`, or set ES_PIPELINE_PG_DSN to an existing server."
    )


def binary(name: str) -> Path:
    """A PostgreSQL program: from the server's folder, else (a bundle of server binaries only) Debian's."""
    for c in [bindir(), *_candidates()]:
        if (c / name).exists():
            return c / name
    raise LocalServerError(f"no `{name}` found beside the PostgreSQL server binaries: install postgresql-client")


def _candidates() -> list[Path]:
    candidates: list[Path] = []
    override = Settings.from_env().pg_bindir
    if override is not None:
        candidates.append(override)
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        candidates.append(Path(out.stdout.strip()))
    debian = Path("/usr/lib/postgresql")
    if debian.is_dir():
        candidates += sorted((p / "bin" for p in debian.iterdir()), key=lambda p: p.parent.name, reverse=True)
    return candidates


def _as_postgres(args: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    """Run a server binary as the `postgres` user: the server refuses to run as root."""
    if os.geteuid() == 0:
        args = ["runuser", "-u", "postgres", "--", *args]
    return subprocess.run(args, text=True, capture_output=True, check=False, **kw)  # type: ignore[call-overload]


def chown_to_postgres(path: Path) -> None:
    if os.geteuid() != 0:
        return
    pw = pwd.getpwnam("postgres")
    os.chown(path, pw.pw_uid, pw.pw_gid)
    for root, dirs, files in os.walk(path):
        os.chown(root, pw.pw_uid, pw.pw_gid)
        for name in dirs + files:
            os.chown(os.path.join(root, name), pw.pw_uid, pw.pw_gid, follow_symlinks=False)


def is_running(data: Path = PGDATA) -> bool:
    res = _as_postgres([str(bindir() / "pg_ctl"), "status", "-D", str(data)])
    return res.returncode == 0


def init(data: Path = PGDATA) -> bool:
    """Create the cluster if missing. Returns True when it was created now."""
    if (data / "PG_VERSION").exists():
        return False
    data.parent.mkdir(parents=True, exist_ok=True)
    chown_to_postgres(data.parent)
    res = _as_postgres(
        [str(bindir() / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C.UTF-8"]
    )
    if res.returncode != 0:
        raise LocalServerError(f"initdb failed: {res.stderr.strip() or res.stdout.strip()}")
    chown_to_postgres(data.parent)
    return True


def start(port: int, data: Path = PGDATA) -> str:
    """Init if needed, start on `port` if stopped, create the project's databases. Idempotent.

    `data` is the cluster's folder: the development server's by default; a test may run a second cluster."""
    log = data.parent / f"{data.name}.log" if data != PGDATA else PGLOG
    created = init(data)
    if not is_running(data):
        log.touch(exist_ok=True)
        chown_to_postgres(log)
        res = _as_postgres(
            [str(bindir() / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(data), "-l", str(log),
             "-o", " ".join(f"-c {k}={v.strip(chr(39))}" for k, v in {**SERVER_SETTINGS, "port": str(port)}.items())]
        )
        if res.returncode != 0:
            tail = log.read_text().strip().splitlines()[-5:] if log.exists() else []
            raise LocalServerError(
                "the local PostgreSQL server did not start: "
                + (res.stderr.strip() or res.stdout.strip())
                + ("\n" + "\n".join(tail) if tail else "")
                + f"\nIs port {port} taken by another server? See {log}."
            )
    _wait_ready(port)
    for db in (LOCAL_PG_DATABASE, LOCAL_DAGSTER_DATABASE):
        _create_database(db, port)
    return "created and started" if created else "running"


def stop(data: Path = PGDATA, *, mode: str = "fast") -> bool:
    """Stop the server; `mode="immediate"` is a crash (no checkpoint; recovery at the next start)."""
    if not (data / "PG_VERSION").exists() or not is_running(data):
        return False
    res = _as_postgres([str(bindir() / "pg_ctl"), "stop", "-w", "-m", mode, "-D", str(data)])
    if res.returncode != 0:
        raise LocalServerError(f"pg_ctl stop failed: {res.stderr.strip()}")
    return True


def _psql(sql: str, port: int, db: str = "postgres") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary("psql")), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-d", db,
         "-tAc", sql],
        text=True, capture_output=True, check=False,
    )


def _wait_ready(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _psql("select 1", port).returncode == 0:
            return
        time.sleep(0.2)
    raise LocalServerError(f"the local server did not accept connections within {timeout:.0f} s; see {PGLOG}")


def _create_database(name: str, port: int) -> None:
    exists = _psql(f"select 1 from pg_database where datname = '{name}'", port).stdout.strip() == "1"
    if not exists:
        res = _psql(f'create database "{name}"', port)
        if res.returncode != 0 and "already exists" not in res.stderr:
            raise LocalServerError(f"could not create database {name}: {res.stderr.strip()}")
