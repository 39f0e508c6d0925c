"""A second PostgreSQL cluster on this machine, and dump/restore between clusters: the drills of a restore."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

from es_pipeline.dev import local_server
from es_pipeline.dev.stack import free_port
from es_pipeline.settings import PROJECT_ROOT, local_pg_dsn


@contextmanager
def another_cluster(name: str) -> Iterator[str]:
    """A fresh cluster (its own initdb, so its own system identifier and transaction ids); its admin DSN."""
    data = PROJECT_ROOT / ".pgdata" / f"drill-{os.getpid()}-{name}"
    port = free_port()
    local_server.start(port, data)
    try:
        yield local_pg_dsn(port, "postgres")
    finally:
        local_server.stop(data)
        shutil.rmtree(data, ignore_errors=True)
        (data.parent / f"{data.name}.log").unlink(missing_ok=True)


def dump(dsn: str, path: Path) -> Path:
    """pg_dump of one database, custom format, as an operator would take it."""
    subprocess.run([str(local_server.bindir() / "pg_dump"), "-Fc", "-f", str(path), "-d", dsn], check=True)
    return path


def restore(dump_file: Path, admin_dsn: str, database: str) -> str:
    """A new database restored from `dump_file` in the cluster of `admin_dsn`; its DSN."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    dsn = admin_dsn.rsplit("/", 1)[0] + "/" + database
    subprocess.run([str(local_server.bindir() / "pg_restore"), "--no-owner", "--exit-on-error", "-d", dsn,
                    str(dump_file)], check=True)
    return dsn
