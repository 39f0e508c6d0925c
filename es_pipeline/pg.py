"""Connections to PostgreSQL: friendly errors, an xid8 loader, a version check."""

from __future__ import annotations

import psycopg
from psycopg.adapt import Loader
from psycopg.conninfo import conninfo_to_dict

from es_pipeline.errors import DatabaseUnreachable, PostgresTooOld

MIN_SERVER_VERSION = 130000


class Xid8Loader(Loader):
    """psycopg 3 has no loader for xid8: read it as a Python int (text format)."""

    def load(self, data: bytes | bytearray | memoryview) -> int:
        return int(bytes(data))


def _describe(dsn: str) -> tuple[str, str, str]:
    try:
        parts = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return ("?", "?", "?")
    return (str(parts.get("host", "localhost")), str(parts.get("port", "5432")), str(parts.get("dbname", "?")))


def connect(dsn: str, *, autocommit: bool = False, application_name: str = "es_pipeline") -> psycopg.Connection:
    """Open a connection, turning every way of failing to reach the server into one clear line."""
    try:
        conn = psycopg.connect(
            dsn, autocommit=autocommit, application_name=application_name, connect_timeout=5
        )
    except psycopg.OperationalError as exc:
        host, port, dbname = _describe(dsn)
        lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
        reason = lines[0].rsplit("failed: ", 1)[-1] if lines else type(exc).__name__
        raise DatabaseUnreachable(host, port, dbname, reason) from None
    except psycopg.ProgrammingError as exc:
        host, port, dbname = _describe(dsn)
        raise DatabaseUnreachable(host, port, dbname, f"invalid DSN ({exc})") from None
    register_types(conn)
    return conn


XID8_OID = 5069  # fixed in pg_type since PostgreSQL 13


def register_types(conn: psycopg.Connection) -> None:
    check_server_version(conn)
    conn.adapters.register_loader(XID8_OID, Xid8Loader)


def check_server_version(conn: psycopg.Connection) -> None:
    if conn.info.server_version < MIN_SERVER_VERSION:
        major = conn.info.server_version // 10000
        raise PostgresTooOld(f"{major} ({conn.info.server_version})")

