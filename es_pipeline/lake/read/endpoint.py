"""The SQL endpoint: Spark's Thrift server (HiveServer2's protocol) on the catalog, for any JDBC or ODBC client.

`es-pipeline sql-endpoint` starts it with the project's Spark configuration (Delta on; the cluster's master when
one is configured) and the catalog (lake/read/metastore.py), after a sync. On localhost by default, where it takes
any user name (`ES_PIPELINE_SQL_ENDPOINT_AUTH=none`); bound to any other address it refuses to start unless clients
must give a password (`password`: HiveServer2's CUSTOM mode with `auth/PasswordFile.java`, the users' PBKDF2 hashes
in `.secrets/sql-endpoint-users`). docs/security.md says who may read what.

The metastore's password reaches the server in a properties file only this user can read, removed once the server
listens: never on a command line, never printed.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from es_pipeline.errors import MetastoreError
from es_pipeline.lake.read import metastore
from es_pipeline.settings import PROJECT_ROOT, Settings

SERVER_CLASS = "org.apache.spark.sql.hive.thriftserver.HiveThriftServer2"
DEFAULT_PORT = 10000
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
USERS_FILE = PROJECT_ROOT / ".secrets" / "sql-endpoint-users"
USERS_ENV = "ES_PIPELINE_SQL_ENDPOINT_USERS"
_AUTH_SOURCE = Path(__file__).parent / "auth" / "PasswordFile.java"
_AUTH_CLASSES = PROJECT_ROOT / ".cache" / "sql-endpoint-auth"
_AUTH_CLASS = "es_pipeline.auth.PasswordFile"
PBKDF2_ITERATIONS = 200_000


def jdbc_url(host: str, port: int, schema: str) -> str:
    shown = "127.0.0.1" if host in {"0.0.0.0", "::"} else host
    return f"jdbc:hive2://{shown}:{port}/{schema}"


def refusal(host: str, auth: str) -> str | None:
    """Why the endpoint must not start so, or None."""
    if host not in LOCAL_HOSTS and auth == "none":
        return (f"the SQL endpoint would listen on {host} with no authentication: anyone who reaches it reads the "
                "whole lake. Set ES_PIPELINE_SQL_ENDPOINT_AUTH=password and add users (`es-pipeline sql-endpoint "
                "--add-user NAME`), or listen on 127.0.0.1 (docs/security.md)")
    return None


# -- the password mode's users -------------------------------------------------------------------------------------


def users_file() -> Path:
    """The password mode's users: ES_PIPELINE_SQL_ENDPOINT_USERS, else `.secrets/sql-endpoint-users`."""
    return Path(os.environ.get(USERS_ENV) or USERS_FILE).resolve()


def add_user(name: str, password: str, users: Path | None = None) -> Path:
    """Add or replace a user of the password mode: only a salted PBKDF2 hash is kept, in a file only this user
    reads; the file."""
    users = users or users_file()
    if not name or any(c in name for c in ":\n\r \t"):
        raise MetastoreError(f"{name!r} is not a user name for the SQL endpoint: no spaces or colons")
    salt = secrets.token_bytes(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, PBKDF2_ITERATIONS)
    users.parent.mkdir(parents=True, exist_ok=True)
    kept = [line for line in (users.read_text().splitlines() if users.exists() else [])
            if line.split(":", 1)[0] != name]
    fd = os.open(users, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write("".join(f"{line}\n" for line in [*kept, f"{name}:{PBKDF2_ITERATIONS}:{salt.hex()}:{digest.hex()}"]))
    os.chmod(users, 0o600)
    return users


def auth_classes() -> Path:
    """The password mode's check, compiled once against the Thrift server's jar (a JDK's javac, first use only)."""
    import pyspark

    built = _AUTH_CLASSES / "es_pipeline" / "auth" / "PasswordFile.class"
    if built.exists() and built.stat().st_mtime >= _AUTH_SOURCE.stat().st_mtime:
        return _AUTH_CLASSES
    javac = _javac()
    jars = Path(pyspark.__file__).parent / "jars"
    _AUTH_CLASSES.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([javac, "--release", "17", "-cp", f"{jars}/*", "-d", str(_AUTH_CLASSES), str(_AUTH_SOURCE)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise MetastoreError(f"cannot build the SQL endpoint's password check: {done.stderr.strip()[-500:]}")
    return _AUTH_CLASSES


def _javac() -> str:
    from es_pipeline.lake.spark.java import java_binary

    java = java_binary()
    candidates = [Path(java).resolve().parent / "javac"] if java else []
    found = next((str(c) for c in candidates if c.exists()), None) or shutil.which("javac")
    if not found:
        raise MetastoreError("ES_PIPELINE_SQL_ENDPOINT_AUTH=password builds its check once with a JDK's javac, and "
                             "there is none: install a JDK 17 or 21 (`apt-get install openjdk-17-jdk-headless`)")
    return found


# -- the server ----------------------------------------------------------------------------------------------------


def server_conf(settings: Settings, ms: metastore.Metastore, host: str, port: int) -> dict[str, str]:
    """The Thrift server's whole configuration: the project's Spark settings, the catalog, where it listens, and
    how it checks clients."""
    from es_pipeline.lake.spark import spark_conf

    conf = {k: str(v) for k, v in spark_conf(settings).items()}
    conf |= metastore.spark_catalog_conf(ms)
    # Every jar on the driver's own class path: the server opens a client's session on a thread whose class loader
    # does not see `spark.jars`, and Delta's catalog must load there.
    conf["spark.driver.extraClassPath"] = ":".join(conf["spark.jars"].split(","))
    conf |= {
        "spark.app.name": "es_pipeline-sql-endpoint",
        "spark.log.level": "WARN",
        "spark.hadoop.hive.server2.thrift.bind.host": host,
        "spark.hadoop.hive.server2.thrift.port": str(port),
        "spark.hadoop.hive.server2.transport.mode": "binary",
        "spark.hadoop.hive.server2.enable.doAs": "false",
    }
    if settings.sql_endpoint_auth == "password":
        conf["spark.driver.extraClassPath"] += f":{auth_classes()}"
        conf |= {"spark.hadoop.hive.server2.authentication": "CUSTOM",
                 "spark.hadoop.hive.server2.custom.authentication.class": _AUTH_CLASS}
    else:
        conf["spark.hadoop.hive.server2.authentication"] = "NONE"
    return conf


def serve(settings: Settings, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
          say: Callable[[str], None] = print, ready: Callable[[], None] = lambda: None) -> int:
    """Run the endpoint until it ends or this process is told to stop; its exit status."""
    import pyspark

    from es_pipeline.lake.spark import prepare_local_start

    why = refusal(host, settings.sql_endpoint_auth)
    if why:
        raise MetastoreError(why)
    ms = metastore.Metastore.required(settings)
    metastore.ensure_schema(ms, say)
    if metastore.difference(ms, settings.warehouse):
        _sync_apart(settings)
    say(f"catalog: {len(metastore.registered(ms))} tables in `{ms.schema}`")
    prepare_local_start()
    conf = server_conf(settings, ms, host, port)
    env = dict(os.environ)
    if settings.sql_endpoint_auth == "password":
        env[USERS_ENV] = str(users_file())
    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    with tempfile.TemporaryDirectory(prefix="es_pipeline-endpoint-") as tmp:
        props = Path(tmp) / "spark.properties"
        fd = os.open(props, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write("".join(f"{k} {_escaped(v)}\n" for k, v in conf.items()))
        # HiveServer2's own settings also as --hiveconf (system properties): its CUSTOM mode reads a new HiveConf.
        hive = [arg for k, v in conf.items() if k.startswith("spark.hadoop.hive.server2.")
                for arg in ("--hiveconf", f"{k.removeprefix('spark.hadoop.')}={v}")]
        cmd = [str(submit), "--class", SERVER_CLASS, "--properties-file", str(props),
               "--driver-memory", conf.get("spark.driver.memory", "2g"), "spark-internal", *hive]
        server = subprocess.Popen(cmd, env=env)
        stop = _forward_signals(server)
        try:
            if not _listening(host, port, server, timeout=240):
                if server.poll() is None:
                    server.terminate()
                return server.wait(60) or 1
            props.unlink()  # read: the password is in no file from here on
            say(f"SQL endpoint on {jdbc_url(host, port, ms.schema)} (auth {settings.sql_endpoint_auth}); "
                f"e.g. beeline -u {jdbc_url(host, port, ms.schema)}")
            ready()
            return server.wait()
        finally:
            stop()
            if server.poll() is None:
                server.terminate()
                try:
                    server.wait(30)
                except subprocess.TimeoutExpired:
                    server.kill()


def _sync_apart(settings: Settings) -> None:
    """The catalog synced in a process of its own: its Spark session ends with it, instead of living beside the
    server's for as long as the server runs."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=_sync_child, args=(settings,))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise MetastoreError(f"the catalog's sync failed (exit {child.exitcode}): `es-pipeline catalog sync` says why")


def _sync_child(settings: Settings) -> None:
    metastore.sync(settings, say=lambda line: print(line, flush=True))


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _listening(host: str, port: int, server: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    target = "127.0.0.1" if host in {"0.0.0.0", "localhost"} else host
    while time.monotonic() < deadline:
        if server.poll() is not None:
            print(f"es-pipeline: the SQL endpoint ended while starting (exit {server.returncode})", file=sys.stderr)
            return False
        try:
            with socket.create_connection((target, port), timeout=1):
                return True
        except OSError:
            time.sleep(0.5)
    print(f"es-pipeline: the SQL endpoint did not listen on {host}:{port} within {timeout:.0f} s", file=sys.stderr)
    return False


def _forward_signals(server: subprocess.Popen[bytes]) -> Callable[[], None]:
    """SIGTERM and SIGINT to this process reach the server (it ends; this process then returns its status)."""
    previous = {}

    def forward(signum: int, frame: object) -> None:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread
            pass

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
