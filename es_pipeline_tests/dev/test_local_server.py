"""The local development server asks every connection for a password, which only its passfile holds."""

from __future__ import annotations

import os
import shutil
import stat
import threading
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from es_pipeline.dev import local_server
from es_pipeline.dev.stack import free_port
from es_pipeline.settings import LOCAL_PG_PASSFILE, PROJECT_ROOT


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


@pytest.mark.slow
def test_two_clusters_start_side_by_side_while_a_neighbour_churns_its_files_and_neither_touches_the_other() -> None:
    """Parallel tiers each start clusters in `.pgdata/`, beside others that are running. A start takes only what it
    made: no walk of the folder (a neighbour's file removed meanwhile failed a whole tier's set-up), no chown of
    a neighbour's files."""
    root = PROJECT_ROOT / ".pgdata" / f"race-{os.getpid()}"
    churn = root / "neighbour"  # a running cluster's files, made and removed all the time, and not the postgres user's
    churn.mkdir(parents=True)
    stop = threading.Event()

    def churning() -> None:
        n = 0
        while not stop.is_set():
            for i in range(50):
                (churn / f"{n}-{i}").write_text("x")
            for i in range(50):
                (churn / f"{n}-{i}").unlink()
            n += 1

    worker = threading.Thread(target=churning)
    worker.start()
    clusters = [root / "a", root / "b"]
    errors: list[BaseException] = []

    def start(data: Path) -> None:
        try:
            local_server.start(free_port(), data)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    starters = [threading.Thread(target=start, args=(data,)) for data in clusters]
    try:
        for t in starters:
            t.start()
        for t in starters:
            t.join(180)
        assert not errors, errors
        assert all(local_server.is_running(data) for data in clusters)
        (churn / "kept").write_text("x")
        local_server.start(free_port(), root / "c")  # one more, with a file of the neighbour's standing still
        assert (churn / "kept").stat().st_uid == os.geteuid()  # not given to the postgres user
        assert churn.stat().st_uid == os.geteuid()
    finally:
        stop.set()
        worker.join()
        for data in [*clusters, root / "c"]:
            if (data / "PG_VERSION").exists():
                local_server.stop(data, mode="immediate")
        shutil.rmtree(root, ignore_errors=True)
