"""What the benchmarks share: sizes, throwaway databases, the work folder, the Spark session, timing."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from es_pipeline.dev.workload import bulk_load
from es_pipeline.extraction.slices import NUM_SLICES, SliceRange
from es_pipeline.lake.spark import delta_jars, spark_conf
from es_pipeline.settings import PROJECT_ROOT, Settings, local_pg_dsn
from es_pipeline.store.migrations import migrate

BENCH_DIR = PROJECT_ROOT / "bench"
WORK_ROOT = Path(os.environ.get("BENCH_WORK") or BENCH_DIR / "work")  # git-ignored scratch: lakes, Spark warehouse
# BENCH_RESULTS: elsewhere than the committed results (the smoke run of `make test` writes to a temporary folder).
RESULTS_DIR = Path(os.environ.get("BENCH_RESULTS") or BENCH_DIR / "results")

SCHEMA = "es"
SPARK_MASTER = "local[2]"
EVENTS_PER_STREAM = 50  # bulk_load(streams = events // 50)
EVENTS_PER_TX = 100_000
ALL_SLICES = SliceRange(0, NUM_SLICES - 1)
DEFAULT_DATABASE = "bench_es"
HORIZON_TIMEOUT_S = 600.0

log = logging.getLogger("bench")


# -- sizes ---------------------------------------------------------------------------------------------


def _env_int(env: Mapping[str, str], name: str, default: int, *, least: int = EVENTS_PER_STREAM,
             unit: str = "events") -> int:
    text = env.get(name, "").replace("_", "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise SystemExit(f"{name}={env[name]!r}: expected a whole number of {unit}") from None
    if value < least:
        raise SystemExit(f"{name}={value}: need at least {least} {unit}")
    return value


def _whole_streams(n: int) -> int:
    """Round down to whole bulk streams, so that a later bulk_load can append to them."""
    return n - n % EVENTS_PER_STREAM


@dataclass(frozen=True)
class Sizes:
    events: int  # extract_backfill; extract_memory runs N and 2N
    small: int  # extract_incremental: lake size before the first series of increments
    large: int  # extract_incremental: lake size before the second series
    increment: int = 1_000
    repeats: int = 5

    @classmethod
    def resolve(cls, *, quick: bool, environ: Mapping[str, str] | None = None) -> Sizes:
        """Defaults, or `--quick` ones; BENCH_EVENTS / BENCH_SMALL / BENCH_LARGE / BENCH_REPEATS override both."""
        env = os.environ if environ is None else environ
        events = _env_int(env, "BENCH_EVENTS", 200_000 if quick else 5_000_000)
        small = _whole_streams(_env_int(env, "BENCH_SMALL", 100_000 if quick else 1_000_000))
        large = _env_int(env, "BENCH_LARGE", 1_000_000 if quick else 10_000_000)
        if large <= small:
            raise SystemExit(f"BENCH_LARGE ({large}) must be larger than BENCH_SMALL ({small})")
        repeats = _env_int(env, "BENCH_REPEATS", 5, least=1, unit="repeats")
        return cls(events=events, small=small, large=large, repeats=repeats)


# -- databases -----------------------------------------------------------------------------------------


def admin_dsn() -> str:
    return os.environ.get("BENCH_PG_ADMIN_DSN") or local_pg_dsn(Settings.from_env().local_pg_port, "postgres")


def database_name() -> str:
    name = os.environ.get("BENCH_DB", DEFAULT_DATABASE)
    # Benchmarks drop and recreate their database: never let that touch one that is not ours.
    if not re.fullmatch(r"bench_[a-z0-9_]+", name):
        raise SystemExit(f"BENCH_DB={name!r}: the benchmark database's name must match bench_[a-z0-9_]+")
    return name


def database_dsn(name: str) -> str:
    return make_conninfo(admin_dsn(), dbname=name)


def fresh_database(name: str) -> str:
    """Drop `name` if it exists, create it empty, apply the migrations; return its DSN."""
    with psycopg.connect(admin_dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = database_dsn(name)
    migrate(dsn, SCHEMA)
    return dsn


def drop_database(name: str) -> None:
    with psycopg.connect(admin_dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def load_events(dsn: str, events: int, streams: int) -> float:
    """Bulk-append `events` demo events over `streams` streams, then VACUUM ANALYZE; return seconds."""
    chunks = -(-events // EVENTS_PER_TX)
    every = max(1, chunks // 5)
    calls = 0

    def progress(line: str) -> None:  # one call per committed chunk: log about five of them
        nonlocal calls
        calls += 1
        if calls % every == 0 or calls == chunks:
            log.info("  %s", line)

    t0 = time.perf_counter()
    bulk_load(dsn, events=events, streams=streams, schema=SCHEMA, events_per_tx=EVENTS_PER_TX, progress=progress)
    vacuum_analyze(dsn)
    return time.perf_counter() - t0


def vacuum_analyze(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("VACUUM ANALYZE {}.events").format(sql.Identifier(SCHEMA)))


def wait_until_extractable(dsn: str, timeout: float = HORIZON_TIMEOUT_S) -> float:
    """Wait until the horizon has passed every transaction committed so far; return the seconds waited.

    The horizon is server-wide: an open transaction in any database of the server (another test
    run, say) holds it back, and an extraction would then leave committed events for later.
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint").fetchone()
        assert row is not None
        target = int(row[0])  # every xid assigned so far is below it
        t0 = time.perf_counter()
        while True:
            row = conn.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint").fetchone()
            assert row is not None
            if int(row[0]) >= target:
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(
                    f"the horizon stayed below xid {target} for {timeout:.0f} s: a transaction elsewhere on "
                    "the server holds it back (see pg_stat_activity.backend_xid)"
                )
            time.sleep(0.2)


def server_version(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "?"


# -- Spark ---------------------------------------------------------------------------------------------


def spark_session(warehouse: Path, *, extra_jars: Sequence[Path] = ()) -> Any:
    """The process's one Spark session: es_pipeline's own configuration at local[2], plus `extra_jars`."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # as `make` sets it: workers use this venv
    delta_jars()
    settings = replace(Settings.from_env(), warehouse=warehouse, spark_master=SPARK_MASTER)
    conf = spark_conf(settings, master=SPARK_MASTER)
    if extra_jars:
        conf["spark.jars"] = ",".join([conf["spark.jars"], *(str(j) for j in extra_jars)])
    builder = SparkSession.builder
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


# -- figures -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """One timed measurement: how many events in how many seconds, plus raw side figures."""

    label: str
    events: int
    seconds: float
    extra: Mapping[str, Any] | None = None

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "events": self.events,
            "seconds": round(self.seconds, 4),
            "events_per_second": round(self.rate, 1),
            **dict(self.extra or {}),
        }
