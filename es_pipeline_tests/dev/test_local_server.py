"""The local development server asks every connection for a password, which only its passfile holds."""

from __future__ import annotations

import stat

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from es_pipeline.settings import LOCAL_PG_PASSFILE


def test_without_the_passfile_the_local_server_refuses_even_its_superuser(
    pg_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(pg_server) as conn:  # the DSN names the passfile: it works
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
    parts = conninfo_to_dict(pg_server)
    assert parts["passfile"] == str(LOCAL_PG_PASSFILE) and "password" not in parts
    parts.pop("passfile")
    monkeypatch.setenv("PGPASSFILE", "/nonexistent")
    monkeypatch.delenv("PGPASSWORD", raising=False)
    with pytest.raises(psycopg.OperationalError, match="no password supplied"):
        psycopg.connect(make_conninfo(**parts))
    for host in ("127.0.0.1", "/tmp"):  # TCP and the socket alike
        with pytest.raises(psycopg.OperationalError, match="no password supplied"):
            psycopg.connect(make_conninfo(**{**parts, "host": host}))
    mode = stat.S_IMODE(LOCAL_PG_PASSFILE.stat().st_mode)
    assert mode == 0o600 and stat.S_IMODE(LOCAL_PG_PASSFILE.parent.stat().st_mode) == 0o700
