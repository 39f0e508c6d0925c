"""A real PgBouncer (Debian's) in front of the test server, in transaction pooling mode by default."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from es_pipeline.dev import local_server
from es_pipeline.dev.stack import free_port, wait_port
from es_pipeline.settings import PROJECT_ROOT


def pgbouncer_binary() -> str:
    found = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not os.path.exists(found):
        raise RuntimeError("PgBouncer is not installed: `apt-get install -y pgbouncer` (.ci/run does it)")
    return found


@contextmanager
def pgbouncer(server_port: int, *, pool_mode: str = "transaction", users: Iterable[str] = ("postgres",)) -> Iterator[int]:
    """PgBouncer listening on a free port of 127.0.0.1, pooling every database of the server for `users`;
    its port."""
    home = PROJECT_ROOT / ".pgdata" / f"pgbouncer-{os.getpid()}"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    # Clients are trusted; PgBouncer logs in to the server with the local servers' password.
    secret = local_server.password()
    (home / "users.txt").write_text("".join(f'"{user}" "{secret}"\n' for user in users))
    (home / "users.txt").chmod(0o600)
    (home / "pgbouncer.ini").write_text(
        f"[databases]\n* = host=127.0.0.1 port={server_port}\n\n[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {home}/users.txt\npool_mode = {pool_mode}\n"
        "default_pool_size = 20\nmax_client_conn = 200\n"
        f"logfile = {home}/pgbouncer.log\npidfile = {home}/pgbouncer.pid\n"
        "ignore_startup_parameters = extra_float_digits,options\n"
    )
    local_server.chown_tree_to_postgres(home)
    proc = subprocess.Popen(["runuser", "-u", "postgres", "--", pgbouncer_binary(), str(home / "pgbouncer.ini")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, 20)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(home, ignore_errors=True)
