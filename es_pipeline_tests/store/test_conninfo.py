"""One DSN for psycopg, ADBC and JDBC: nothing filled in, what JDBC cannot express refused, no password echoed."""

from __future__ import annotations

import psycopg
import pytest

from es_pipeline.errors import DatabaseUnreachable, UnsupportedDsn
from es_pipeline.store.conninfo import (
    KEEPALIVES,
    KeptConnection,
    adbc_dsn,
    connect,
    describe,
    jdbc_url,
    parse,
)

SECRET = "s3cr%t/ab"


@pytest.mark.parametrize(
    "dsn",
    [
        "service=prod",
        "host=/var/run/postgresql dbname=es",
        "host=h1,h2 port=5432,5433 dbname=es",
        "postgresql://u@h1:5432,h2:5433/es?target_session_attrs=read-write",
    ],
)
def test_adbc_gets_the_dsn_as_libpq_reads_it_with_no_host_or_port_filled_in(dsn: str) -> None:
    given, passed = parse(dsn), parse(adbc_dsn(dsn))
    assert passed.pop("application_name") == "es_pipeline reader"
    added = {k: passed.pop(k) for k in ("connect_timeout", *KEEPALIVES)}
    assert passed == given
    assert added == {"connect_timeout": "10", **KEEPALIVES}  # what is added: timeouts, never a host or port


def test_jdbc_keeps_every_host_port_and_tls_setting() -> None:
    url, props = jdbc_url(parse(
        f"host=h1,h2 port=5432,5433 dbname=es user=reader password={SECRET} sslmode=verify-full sslrootcert=/ca.pem"
    ))
    assert url == "jdbc:postgresql://h1:5432,h2:5433/es"
    session_init = props.pop("sessionInitStatement")
    assert props == {"driver": "org.postgresql.Driver", "user": "reader", "password": SECRET,
                     "sslmode": "verify-full", "sslrootcert": "/ca.pem", "tcpKeepAlive": "true", "connectTimeout": "10"}
    assert "statement_timeout" in session_init and "set_config" in session_init


def test_jdbc_names_no_user_or_port_the_dsn_does_not_name() -> None:
    url, props = jdbc_url(parse("postgresql://db.example/es"))
    assert url == "jdbc:postgresql://db.example/es"
    assert "user" not in props and "password" not in props


@pytest.mark.parametrize(
    ("dsn", "why"),
    [
        (f"service=prod password={SECRET}", "service files"),
        (f"host=/var/run/postgresql dbname=es password={SECRET}", "Unix socket"),
        (f"dbname=es password={SECRET}", "no host"),
        (f"host=h1,h2 port=1,2,3 password={SECRET}", "2 hosts but 3 ports"),
    ],
)
def test_what_jdbc_cannot_express_is_refused_in_one_line_without_the_password(dsn: str, why: str) -> None:
    with pytest.raises(UnsupportedDsn) as err:
        jdbc_url(parse(dsn))
    message = str(err.value)
    assert why in message and "JDBC" in message and "\n" not in message
    assert SECRET not in message and "s3cr" not in message


def test_an_unparsable_dsn_is_refused_without_quoting_it() -> None:
    bad = f"host=h password='{SECRET}"  # an unterminated quote
    with pytest.raises(UnsupportedDsn) as err:
        adbc_dsn(bad)
    assert "s3cr" not in str(err.value)
    with pytest.raises(DatabaseUnreachable) as unreachable:
        connect(bad)
    assert "s3cr" not in str(unreachable.value)


def test_describe_says_what_the_dsn_leaves_to_libpq() -> None:
    assert describe("postgresql://u@127.0.0.1:1/nowhere") == ("127.0.0.1", "1", "nowhere")
    host, port, dbname = describe("service=prod")
    assert "default" in host and "default" in port and "default" in dbname


def test_a_kept_connection_is_reused_and_replaced_when_the_server_ended_it(dsn: str) -> None:
    kept = KeptConnection(dsn, "es_pipeline test kept")
    pid = lambda conn: conn.execute("SELECT pg_backend_pid()").fetchone()[0]  # noqa: E731
    first = kept.run(pid)
    assert kept.run(pid) == first  # the same server connection, tick after tick
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (first,))
    second = kept.run(pid)  # the call on the ended connection is made again on a new one
    assert second != first
    kept._pid = -1  # as in a forked child: the parent's socket is never used
    assert kept.run(pid) not in (first, second)
    kept.close()
