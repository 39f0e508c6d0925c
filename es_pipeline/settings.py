"""Every setting, read from the environment in one place and validated there.

Nothing reads the environment at import time: `Settings.from_env()` does, when asked, and refuses a
bad value with one line naming the variable, what it holds and what it accepts. The table of
variables is in README.md ("Settings"). A leaf: this module imports only `errors`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from es_pipeline.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parent.parent

# Who appends extracted batches to the Delta `events` table: delta-rs (Rust, in the run's own
# process, no JVM) or Spark. Both commit the same Delta `txn` action (docs/architecture.md).
WRITERS = ("delta-rs", "spark")
MAX_SLICE_RANGES = 1024  # one slice per range at most (extraction.slices.NUM_SLICES)

# The project's own development server (`es-pipeline db start`): the default event store.
DEFAULT_LOCAL_PG_PORT = 54329
LOCAL_PG_DATABASE = "es_pipeline"
LOCAL_DAGSTER_DATABASE = "dagster"

# A batch (one Delta commit, the unit a crashed run replays) holds at most this many events, and
# about this many bytes by the store's average row width. It streams through the run, so neither
# bounds memory; a single transaction larger than both is still one batch (never split).
DEFAULT_BATCH_EVENTS = 500_000
DEFAULT_BATCH_BYTES = 512 << 20
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def local_pg_dsn(port: int, database: str = LOCAL_PG_DATABASE) -> str:
    """A database on the local development server."""
    return f"postgresql://postgres@127.0.0.1:{port}/{database}"


@dataclass(frozen=True)
class Settings:
    pg_dsn: str
    warehouse: Path
    slice_ranges: int = 8
    spark_master: str = "local[*]"
    spark_remote: str | None = None
    schema: str = "es"
    dagster_home: Path = field(default_factory=lambda: PROJECT_ROOT / ".dagster_home")
    events_writer: str = "delta-rs"
    sensor_interval_seconds: int = 5
    automation: bool = True
    local_pg_port: int = DEFAULT_LOCAL_PG_PORT
    batch_events: int = DEFAULT_BATCH_EVENTS
    batch_bytes: int = DEFAULT_BATCH_BYTES
    pg_bindir: Path | None = None  # server binaries for the local server (default: pg_config's, Debian's)
    pg_dsn_from_env: bool = False  # ES_PIPELINE_PG_DSN set: Dagster gets it as an EnvVar, never its value
    snapshot_dsn: str | None = None  # the snapshot write-back's own role (default: pg_dsn's)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = dict(os.environ if environ is None else environ)
        port = _int(env, "ES_PIPELINE_LOCAL_PG_PORT", DEFAULT_LOCAL_PG_PORT, 1, 65535, "a TCP port (1-65535)")
        return cls(
            pg_dsn=env.get("ES_PIPELINE_PG_DSN") or local_pg_dsn(port),
            warehouse=Path(env.get("ES_PIPELINE_WAREHOUSE") or PROJECT_ROOT / "warehouse"),
            slice_ranges=_int(env, "ES_PIPELINE_SLICE_RANGES", 8, 1, MAX_SLICE_RANGES,
                              f"a whole number of ranges between 1 and {MAX_SLICE_RANGES}"),
            spark_master=env.get("ES_PIPELINE_SPARK_MASTER") or "local[*]",
            spark_remote=env.get("ES_PIPELINE_SPARK_REMOTE") or None,
            schema=env.get("ES_PIPELINE_SCHEMA") or "es",
            dagster_home=Path(env.get("DAGSTER_HOME") or PROJECT_ROOT / ".dagster_home"),
            events_writer=_choice(env, "ES_PIPELINE_EVENTS_WRITER", "delta-rs", WRITERS),
            sensor_interval_seconds=_int(env, "ES_PIPELINE_SENSOR_INTERVAL", 5, 1, 86_400,
                                         "a whole number of seconds between 1 and 86400"),
            automation=_choice(env, "ES_PIPELINE_AUTOMATION", "on", ("on", "off")) == "on",
            local_pg_port=port,
            batch_events=_int(env, "ES_PIPELINE_BATCH_EVENTS", DEFAULT_BATCH_EVENTS, 1, 100_000_000,
                              "a whole number of events between 1 and 100000000"),
            batch_bytes=_bytes(env, "ES_PIPELINE_BATCH_BYTES", DEFAULT_BATCH_BYTES),
            pg_bindir=Path(env["ES_PIPELINE_PG_BINDIR"]) if env.get("ES_PIPELINE_PG_BINDIR") else None,
            pg_dsn_from_env=bool(env.get("ES_PIPELINE_PG_DSN")),
            snapshot_dsn=env.get("ES_PIPELINE_SNAPSHOT_DSN") or None,
        )


def _int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int, expected: str) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(name, text, expected) from None
    if not lo <= value <= hi:
        raise ConfigError(name, text, expected)
    return value


def _bytes(env: Mapping[str, str], name: str, default: int) -> int:
    """A size: a whole number of bytes, or with a binary unit (`512MB`, `2GiB`, `64k`)."""
    text = env.get(name, "").strip()
    if not text:
        return default
    number = text.rstrip("bBkKmMgGiI ")
    unit = text[len(number):].strip().lower()
    try:
        value = int(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ConfigError(name, text, "a size in bytes, e.g. 536870912 or 512MB or 2GiB") from None
    if value < 1 << 20:
        raise ConfigError(name, text, "a size of at least 1MB")
    return value


def _choice(env: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = env.get(name, "").strip() or default
    if value not in allowed:
        raise ConfigError(name, value, " or ".join(allowed))
    return value
