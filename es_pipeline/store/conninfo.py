"""PostgreSQL connection strings and connections, from one place, for every read path.

One DSN (`ES_PIPELINE_PG_DSN`, a libpq key=value string or a `postgresql://` URI) reaches three
clients, and each gets it from here:

- psycopg (`connect`): the offsets, the probe, the event store's writers;
- ADBC (`adbc_dsn`): the Arrow reads of the extractor. libpq parses the string itself, so
  `service=`, socket directories, multi-host lists and `PG*` variables mean the same as for psycopg;
- JDBC (`jdbc_url` of `resolved`): Spark's executors on a cluster. pgjdbc has its own syntax and
  reads neither libpq's service files nor its passfiles, so the driver connects once with libpq and
  hands pgjdbc what libpq used: the service file's host and TLS settings, the password from
  PGPASSWORD or a passfile. What pgjdbc cannot express (a socket directory, a count of ports that does
  not match the hosts) is refused with one line, never replaced by a default such as localhost:5432.

No function here puts the DSN's text into an error message: it may hold a password.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TypeVar

import psycopg
from psycopg.adapt import Loader
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from es_pipeline.errors import DatabaseUnreachable, PostgresTooOld, UnsupportedDsn

T = TypeVar("T")

MIN_SERVER_VERSION = 130000
XID8_OID = 5069  # fixed in pg_type since PostgreSQL 13
JDBC_DRIVER_CLASS = "org.postgresql.Driver"
# A dead server or network is noticed within about a minute instead of hanging a run (unless the DSN says otherwise).
KEEPALIVES = {"keepalives": "1", "keepalives_idle": "30", "keepalives_interval": "10", "keepalives_count": "3"}
# es_pipeline's own statements are never cut by timeouts a role sets for applications: a batch killed by a
# statement_timeout would be killed again on every replay. Those the server knows are set to 0 (the later
# ones exist from PostgreSQL 14 and 17), for the session or, with `true`, for the current transaction only.
TIMEOUTS = ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout", "idle_session_timeout",
            "transaction_timeout")


def no_timeouts_sql(*, local: bool) -> str:
    # `current_setting(name, true)` is NULL for a setting the server does not know; `pg_settings` would say the
    # same, but builds a row for every setting first (1.5 ms of the server's CPU, at every read of a tailing pass).
    names = ", ".join(f"'{n}'" for n in TIMEOUTS)
    return (f"SELECT set_config(n, '0', {'true' if local else 'false'}) FROM unnest(ARRAY[{names}]) AS n "
            "WHERE current_setting(n, true) IS NOT NULL")


def int_array(values: Iterable[int]) -> str:
    """A PostgreSQL array literal of whole numbers (`'{1,2,3}'`), for a parameter cast to an array type: a tailing
    pass names its 1024 slices in several statements, and psycopg's dumping of a list costs a millisecond each."""
    return "{" + ",".join(str(int(v)) for v in values) + "}"


# libpq parameters that pgjdbc takes under the same name.
_JDBC_SAME_NAME = ("sslmode", "sslrootcert", "sslcert", "sslkey")


def parse(dsn: str) -> dict[str, str]:
    """The DSN's parameters (only those it names: libpq's defaults are not filled in)."""
    try:
        return {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    except psycopg.ProgrammingError:
        raise UnsupportedDsn(
            "es_pipeline", "it is not a valid libpq connection string (key=value pairs or a postgresql:// URI)"
        ) from None


def describe(dsn: str) -> tuple[str, str, str]:
    """(host, port, database) as the DSN names them, for messages; what it leaves to libpq says so."""
    try:
        parts = parse(dsn)
    except UnsupportedDsn:
        return ("?", "?", "?")
    return (parts.get("host", "(libpq's default host)"), parts.get("port", "(default port)"),
            parts.get("dbname", "(default database)"))


class Xid8Loader(Loader):
    """psycopg 3 has no loader for xid8: read it as a Python int (text format)."""

    def load(self, data: bytes | bytearray | memoryview) -> int:
        return int(bytes(data))


def connect(dsn: str, *, autocommit: bool = False, application_name: str = "es_pipeline") -> psycopg.Connection:
    """Open a psycopg connection, turning every way of failing to reach the server into one clear line.

    No server-side prepared statements (`prepare_threshold=None`): behind a transaction-pooling PgBouncer
    a statement prepared on one server connection is not there on the next.
    """
    try:
        conninfo = make_conninfo(dsn, **_unless_named(dsn, {**KEEPALIVES, "connect_timeout": "5"}))
    except UnsupportedDsn:
        host, port, dbname = describe(dsn)
        raise DatabaseUnreachable(host, port, dbname, "the DSN is not a valid libpq connection string") from None
    try:
        conn = psycopg.connect(conninfo, autocommit=autocommit, application_name=application_name,
                               prepare_threshold=None)
    except psycopg.OperationalError as exc:
        host, port, dbname = describe(dsn)
        lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
        reason = lines[0].rsplit("failed: ", 1)[-1] if lines else type(exc).__name__
        raise DatabaseUnreachable(host, port, dbname, reason) from None
    except psycopg.ProgrammingError:
        host, port, dbname = describe(dsn)
        raise DatabaseUnreachable(host, port, dbname, "the DSN is not a valid libpq connection string") from None
    register_types(conn)
    return conn


def lock_transaction(dsn: str, *, application_name: str) -> psycopg.Connection:
    """A connection with a transaction open to hold transaction-level advisory locks for a while.

    A transaction keeps its server connection even behind a transaction-pooling PgBouncer. In READ
    COMMITTED (whatever the role's default) it keeps no snapshot between statements and takes no
    transaction id, so it holds back neither the horizon nor vacuum; no role timeout may end it while
    it waits for a lock or idles. Rolling it back, or closing it, releases its locks.
    """
    conn = connect(dsn, autocommit=False, application_name=application_name)
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
    conn.execute(no_timeouts_sql(local=True))
    return conn


def register_types(conn: psycopg.Connection) -> None:
    check_server_version(conn)
    conn.adapters.register_loader(XID8_OID, Xid8Loader)


def check_server_version(conn: psycopg.Connection) -> None:
    if conn.info.server_version < MIN_SERVER_VERSION:
        major = conn.info.server_version // 10000
        raise PostgresTooOld(f"{major} ({conn.info.server_version})")


def adbc_dsn(dsn: str, *, application_name: str = "es_pipeline reader") -> str:
    """The DSN for ADBC's PostgreSQL driver, which hands it to libpq as it is (key=value form)."""
    parse(dsn)  # a clear error before the driver's, which would quote the string
    return make_conninfo(dsn, application_name=application_name,
                         **_unless_named(dsn, {**KEEPALIVES, "connect_timeout": "10"}))


def _unless_named(dsn: str, defaults: dict[str, str]) -> dict[str, str]:
    """`defaults` for the parameters the DSN does not name itself."""
    named = parse(dsn)
    return {k: v for k, v in defaults.items() if k not in named}


def resolved(dsn: str) -> dict[str, str]:
    """The parameters libpq connected with: the DSN's, the service file's, the PG* variables', and the
    password wherever libpq found it (the DSN, PGPASSWORD, a passfile). One connection, closed at once."""
    with connect(dsn, autocommit=True, application_name="es_pipeline jdbc") as conn:
        params = {o.keyword.decode(): o.val.decode() for o in conn.pgconn.info if o.val}
        password = conn.pgconn.password
    for used in ("service", "passfile", "password"):  # already applied by libpq; the password comes from PQpass
        params.pop(used, None)
    if password:
        params["password"] = password.decode()
    return params


def jdbc_url(parts: dict[str, str]) -> tuple[str, dict[str, str]]:
    """Connection parameters (`resolved(dsn)`) as pgjdbc's URL and connection properties, for Spark's
    JDBC reads on executors."""
    if "service" in parts:
        raise UnsupportedDsn("the JDBC read path", "pgjdbc does not read service files; pass resolved(dsn)")
    hosts = [h for h in parts.get("host", "").split(",") if h]
    if not hosts:
        raise UnsupportedDsn("the JDBC read path", "it names no host, and pgjdbc cannot use libpq's default; add host=")
    if any(h.startswith(("/", "@")) for h in hosts):
        raise UnsupportedDsn("the JDBC read path", "pgjdbc cannot connect through a Unix socket directory; use a TCP host")
    ports = [p for p in parts.get("port", "").split(",") if p] or [""]
    if len(ports) not in (1, len(hosts)):
        raise UnsupportedDsn("the JDBC read path", f"it names {len(hosts)} hosts but {len(ports)} ports")
    ports = ports * len(hosts) if len(ports) == 1 else ports
    netloc = ",".join(f"{h}:{p}" if p else h for h, p in zip(hosts, ports, strict=True))
    props = {"driver": JDBC_DRIVER_CLASS, "tcpKeepAlive": "true", "connectTimeout": parts.get("connect_timeout", "10"),
             "sessionInitStatement": no_timeouts_sql(local=False)}  # the last is Spark's, run as each session opens
    for key in ("user", "password", *_JDBC_SAME_NAME):
        if parts.get(key):
            props[key] = parts[key]
    return f"jdbc:postgresql://{netloc}/{parts.get('dbname', '')}", props


class KeptConnection:
    """One autocommit connection kept for calls after calls in this process (the sensor's ticks): a tick then
    pays no connection set-up (TLS, SCRAM, a pooler's hand-off). It is opened again after a fork (a child never
    uses its parent's socket) and when the server ended it (a restart, `idle_session_timeout`): a call on a kept
    connection that fails so is made once more on a new one. No prepared statements (`connect`)."""

    def __init__(self, dsn: str, application_name: str) -> None:
        self.dsn, self.application_name = dsn, application_name
        self._conn: psycopg.Connection | None = None
        self._pid = 0

    def run(self, fn: Callable[[psycopg.Connection], T]) -> T:
        while True:
            reused = self._conn is not None and self._pid == os.getpid() and not self._conn.closed
            if not reused:
                self._conn, self._pid = connect(self.dsn, autocommit=True, application_name=self.application_name), os.getpid()
            assert self._conn is not None
            try:
                return fn(self._conn)
            except psycopg.OperationalError:
                self.close()
                if not reused:
                    raise

    def close(self) -> None:
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None
