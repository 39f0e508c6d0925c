"""A second PostgreSQL cluster on this machine, and dump/restore between clusters: the drills of a restore."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from es_pipeline.dev import local_server
from es_pipeline.dev.stack import free_port
from es_pipeline.settings import PROJECT_ROOT, local_pg_dsn
from es_pipeline.store import roles


@dataclass(frozen=True)
class Cluster:
    admin_dsn: str
    port: int
    data: Path

    def crash_restart(self) -> None:
        """What a power cut does: stop without a checkpoint, then start (crash recovery)."""
        local_server.stop(self.data, mode="immediate")
        local_server.start(self.port, self.data)


@contextmanager
def another_cluster(name: str) -> Iterator[str]:
    """A fresh cluster (its own initdb, so its own system identifier and transaction ids); its admin DSN."""
    with cluster(name) as c:
        yield c.admin_dsn


@contextmanager
def cluster(name: str) -> Iterator[Cluster]:
    """A fresh cluster of this machine's PostgreSQL, in the project's .pgdata/, removed afterwards."""
    data = PROJECT_ROOT / ".pgdata" / f"drill-{os.getpid()}-{name}"
    port = free_port()
    local_server.start(port, data)
    try:
        yield Cluster(local_pg_dsn(port, "postgres"), port, data)
    finally:
        local_server.stop(data)
        shutil.rmtree(data, ignore_errors=True)
        (data.parent / f"{data.name}.log").unlink(missing_ok=True)


def dump(dsn: str, path: Path) -> Path:
    """pg_dump of one database, custom format, as an operator would take it.

    Skips the test when this machine's pg_dump is older than the server (it refuses to dump a newer
    one): the case of a server from `make test-pg-versions` newer than Debian's client tools.
    """
    pg_dump = local_server.binary("pg_dump")
    tool = int(subprocess.run([str(pg_dump), "--version"], capture_output=True, text=True, check=True)
               .stdout.split()[-1].split(".")[0])
    with psycopg.connect(dsn) as conn:
        server = conn.info.server_version // 10000
    if tool < server:
        pytest.skip(f"pg_dump {tool} cannot dump a PostgreSQL {server} server; install postgresql-client-{server}")
    subprocess.run([str(pg_dump), "-Fc", "-f", str(path), "-d", dsn], check=True)
    return path


def restore(dump_file: Path, admin_dsn: str, database: str) -> str:
    """A new database restored from `dump_file` in the cluster of `admin_dsn`, its grants made again by the
    role model (`es-pipeline db roles`: the new cluster has none of the old one's roles); its DSN."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    dsn = make_conninfo(admin_dsn, dbname=database)
    subprocess.run([str(local_server.binary("pg_restore")), "--no-owner", "--no-acl", "--exit-on-error", "-d", dsn,
                    str(dump_file)], check=True)
    roles.apply(dsn, "es", echo=lambda _: None)
    return dsn
