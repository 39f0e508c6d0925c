"""Settings from the environment (DESIGN §5), read when asked for, never at import time."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent

# The local development server's port. The one setting read at import: it only names the project's
# own dev server, and lets a second checkout on the same machine run its server beside the first.
LOCAL_PG_PORT = int(os.environ.get("ES_PIPELINE_LOCAL_PG_PORT", "54329"))
LOCAL_PG_DATABASE = "es_pipeline"
LOCAL_DAGSTER_DATABASE = "dagster"
LOCAL_PG_DSN = f"postgresql://postgres@127.0.0.1:{LOCAL_PG_PORT}/{LOCAL_PG_DATABASE}"


@dataclass(frozen=True)
class Settings:
    pg_dsn: str
    warehouse: Path
    slice_ranges: int
    spark_master: str
    spark_remote: str | None
    schema: str
    dagster_home: Path
    events_writer: str = "delta-rs"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if environ is None else environ)
        ranges_text = env.get("ES_PIPELINE_SLICE_RANGES", "8")
        try:
            ranges = int(ranges_text)
        except ValueError:
            from es_pipeline.errors import ConfigError

            raise ConfigError(
                "ES_PIPELINE_SLICE_RANGES", ranges_text, "a whole number of ranges between 1 and 1024"
            ) from None
        return cls(
            pg_dsn=env.get("ES_PIPELINE_PG_DSN", LOCAL_PG_DSN),
            warehouse=Path(env.get("ES_PIPELINE_WAREHOUSE", str(PROJECT_ROOT / "warehouse"))),
            slice_ranges=ranges,
            spark_master=env.get("ES_PIPELINE_SPARK_MASTER", "local[*]"),
            spark_remote=env.get("ES_PIPELINE_SPARK_REMOTE") or None,
            schema=env.get("ES_PIPELINE_SCHEMA", "es"),
            dagster_home=Path(env.get("DAGSTER_HOME", str(PROJECT_ROOT / ".dagster_home"))),
            events_writer=_events_writer(env.get("ES_PIPELINE_EVENTS_WRITER", "delta-rs")),
        )


def _events_writer(value: str) -> str:
    from es_pipeline.extract import WRITERS

    if value not in WRITERS:
        from es_pipeline.errors import ConfigError

        raise ConfigError("ES_PIPELINE_EVENTS_WRITER", value, " or ".join(WRITERS))
    return value
