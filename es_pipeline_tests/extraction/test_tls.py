"""TLS end to end: a cluster that refuses every connection without TLS, a certificate made by openssl
here, and `sslmode=verify-full`; the psycopg, ADBC and JDBC read paths all extract through it."""

from __future__ import annotations

import os
import pwd
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from es_pipeline.errors import DatabaseUnreachable
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.store import roles
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline.store.migrations import migrate
from es_pipeline_tests.support.cluster import cluster
from es_pipeline_tests.support.lakecheck import assert_exactly_once

SECRET_ROLE, SECRET = "es_secret", "pw-from-libpq-9f3a"
CERT_ROLE = "es_cert"  # logs in with a client certificate (CN=es_cert) and no password


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(folder: Path) -> None:
    """A CA, and a server certificate it signed for localhost and 127.0.0.1."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=es-pipeline test CA",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=folder)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "server.key",
             "-out", "server.csr", cwd=folder)
    (folder / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-out", "server.crt", "-extfile", "san.ext", cwd=folder)


@pytest.fixture(scope="module")
def tls_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(a verify-full DSN of a migrated store with 300 events, the CA certificate) on a TLS-only cluster."""
    with cluster("tls") as c:
        _certificates(c.data)
        pg = pwd.getpwnam("postgres")
        for name in ("server.key", "server.crt"):
            (c.data / name).chmod(0o600)
            os.chown(c.data / name, pg.pw_uid, pg.pw_gid)
        hba = c.data / "pg_hba.conf"
        hba.write_text("hostnossl all all 0.0.0.0/0 reject\nhostnossl all all ::/0 reject\n"
                       f"hostssl all {SECRET_ROLE} 0.0.0.0/0 scram-sha-256\nhostssl all {CERT_ROLE} 0.0.0.0/0 cert\n"
                       + hba.read_text())
        with psycopg.connect(c.admin_dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET ssl = on")
            conn.execute("ALTER SYSTEM SET ssl_ca_file = 'ca.crt'")  # client certificates signed by the test CA
            conn.execute("SELECT pg_reload_conf()")
        ca = tmp_path_factory.mktemp("tls") / "ca.crt"
        ca.write_bytes((c.data / "ca.crt").read_bytes())
        (ca.parent / "ca.key").write_bytes((c.data / "ca.key").read_bytes())  # to sign a client certificate
        admin = make_conninfo(c.admin_dsn, host="localhost", sslmode="verify-full", sslrootcert=str(ca))
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("CREATE DATABASE es_tls")
        dsn = make_conninfo(admin, dbname="es_tls")
        migrate(dsn)
        roles.apply(dsn, "es", echo=lambda _: None)
        with psycopg.connect(admin, autocommit=True) as conn:  # es_pipeline's login: the extractor role, scram
            conn.execute("SET password_encryption = 'scram-sha-256'")  # 13's default is md5
            conn.execute(f"CREATE ROLE {SECRET_ROLE} LOGIN PASSWORD '{SECRET}' IN ROLE {roles.EXTRACTOR}")
            conn.execute(f"CREATE ROLE {CERT_ROLE} LOGIN IN ROLE {roles.EXTRACTOR}")
        store = EventStore(dsn)
        for i in range(100):
            store.append(f"tls-{i}", "doc", [NewEvent("Written", {"i": i, "n": n}) for n in range(3)], 0)
        yield dsn, ca


def test_without_tls_the_cluster_refuses(tls_store: tuple[str, Path]) -> None:
    dsn, _ = tls_store
    with pytest.raises(DatabaseUnreachable, match="no encryption|SSL off|pg_hba"):
        Extractor(make_conninfo(dsn, sslmode="disable"), None, Path("/nonexistent")).run(SliceRange(0, 1023))


def test_a_certificate_from_another_ca_is_refused(tls_store: tuple[str, Path], tmp_path: Path) -> None:
    dsn, _ = tls_store
    _certificates(tmp_path)
    with pytest.raises(DatabaseUnreachable, match="certificate verify failed"):
        Extractor(make_conninfo(dsn, sslrootcert=str(tmp_path / "ca.crt")), None, tmp_path / "w").run(SliceRange(0, 1023))


def test_psycopg_adbc_and_jdbc_all_extract_over_verify_full(
    tls_store: tuple[str, Path], spark: Any, tmp_path: Path
) -> None:
    dsn, _ = tls_store
    extractor = make_conninfo(dsn, user=SECRET_ROLE, password=SECRET)
    arrow_lake, jdbc_lake = tmp_path / "arrow", tmp_path / "jdbc"
    assert Extractor(extractor, None, arrow_lake).run(SliceRange(0, 1023)).rows == 300  # psycopg + ADBC
    assert assert_exactly_once(spark, arrow_lake, dsn) == 300
    with psycopg.connect(dsn, autocommit=True) as conn:  # a second lake: start its offsets again
        conn.execute("DELETE FROM es_pipeline.sinks; DELETE FROM es_pipeline.offsets; DELETE FROM es_pipeline.lake_commits")
    assert Extractor(extractor, spark, jdbc_lake, jdbc_min_rows=1).run(SliceRange(0, 1023)).rows == 300  # Spark over JDBC
    assert assert_exactly_once(spark, jdbc_lake, dsn) == 300


@pytest.mark.parametrize("source", ["PGPASSWORD", "PGPASSFILE"])
def test_the_password_may_come_from_libpqs_own_sources(
    tls_store: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """A DSN without the password, over verify-full, with scram: psycopg and ADBC find it where libpq looks."""
    dsn, _ = tls_store
    parts = conninfo_to_dict(dsn)
    parts.pop("passfile", None)  # the local servers' passfile: libpq would look there, not in PGPASSFILE
    no_password = make_conninfo(**{**parts, "user": SECRET_ROLE})
    with pytest.raises(DatabaseUnreachable, match="password"):
        Extractor(no_password, None, tmp_path / "refused").run(SliceRange(0, 1023))
    with psycopg.connect(dsn, autocommit=True) as conn:  # a lake of its own: start its offsets again
        conn.execute("DELETE FROM es_pipeline.sinks; DELETE FROM es_pipeline.offsets; DELETE FROM es_pipeline.lake_commits")
    if source == "PGPASSWORD":
        monkeypatch.setenv("PGPASSWORD", SECRET)
    else:
        passfile = tmp_path / "pgpass"
        passfile.write_text(f"*:*:*:{SECRET_ROLE}:{SECRET}\n")
        passfile.chmod(0o600)
        monkeypatch.setenv("PGPASSFILE", str(passfile))
    assert Extractor(no_password, None, tmp_path / "lake").run(SliceRange(0, 1023)).rows == 300


def test_a_service_file_and_a_passfile_reach_every_read_path(
    tls_store: tuple[str, Path], spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`service=` alone: libpq reads host, TLS settings and user from the service file and the password from
    the passfile; the JDBC path gets what libpq used (pgjdbc reads neither file on an executor)."""
    dsn, ca = tls_store
    parts = conninfo_to_dict(dsn)
    services = tmp_path / "pg_service.conf"
    services.write_text(f"[lake]\nhost=localhost\nport={parts['port']}\ndbname={parts['dbname']}\n"
                        f"user={SECRET_ROLE}\nsslmode=verify-full\nsslrootcert={ca}\n")
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"localhost:{parts['port']}:*:{SECRET_ROLE}:{SECRET}\n")
    passfile.chmod(0o600)
    monkeypatch.setenv("PGSERVICEFILE", str(services))
    monkeypatch.setenv("PGPASSFILE", str(passfile))
    with psycopg.connect(dsn, autocommit=True) as conn:  # a lake of its own: start its offsets again
        conn.execute("DELETE FROM es_pipeline.sinks; DELETE FROM es_pipeline.offsets; DELETE FROM es_pipeline.lake_commits")
    lake = tmp_path / "lake"
    assert Extractor("service=lake", spark, lake, jdbc_min_rows=1).run(SliceRange(0, 1023)).rows == 300
    assert assert_exactly_once(spark, lake, dsn) == 300


def test_a_client_certificate_reaches_every_read_path(
    tls_store: tuple[str, Path], spark: Any, tmp_path: Path
) -> None:
    """sslcert and sslkey (the `cert` method: no password at all) reach psycopg, ADBC and pgjdbc alike."""
    dsn, ca = tls_store
    ca_key = ca.parent / "ca.key"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={CERT_ROLE}", "-keyout", "client.key",
             "-out", "client.csr", cwd=tmp_path)
    _openssl("x509", "-req", "-in", "client.csr", "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
             "-days", "2", "-out", "client.crt", cwd=tmp_path)
    (tmp_path / "client.key").chmod(0o600)
    parts = conninfo_to_dict(dsn)
    parts.pop("passfile", None)
    with_cert = make_conninfo(**{**parts, "user": CERT_ROLE, "sslcert": str(tmp_path / "client.crt"),
                                 "sslkey": str(tmp_path / "client.key")})
    for lake, kw in ((tmp_path / "arrow", {}), (tmp_path / "jdbc", {"jdbc_min_rows": 1})):
        with psycopg.connect(dsn, autocommit=True) as conn:  # a lake of its own: start its offsets again
            conn.execute("DELETE FROM es_pipeline.sinks; DELETE FROM es_pipeline.offsets; "
                         "DELETE FROM es_pipeline.lake_commits")
        assert Extractor(with_cert, spark, lake, **kw).run(SliceRange(0, 1023)).rows == 300  # type: ignore[arg-type]
        assert assert_exactly_once(spark, lake, dsn) == 300
