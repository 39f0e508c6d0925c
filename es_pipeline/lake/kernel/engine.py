"""The engine rule: where a table's work runs, in this process (pyarrow, DuckDB, delta-rs: no JVM) or on Spark.

One rule for every table and check (docs/architecture.md, "Engines"): `ES_PIPELINE_ENGINE` "spark" always, "local"
never, "auto" where the work's files pass `SPARK_BYTES`. Increments (a few commits of the change feed) run in process
whatever the setting, up to `feed.SMALL_INCREMENT` events.
"""

from __future__ import annotations

from collections.abc import Callable

# `events` Parquet files above which `auto` does the work on Spark. In process it is read in bounded pieces
# (lake/delta/pieces.py): its memory does not grow with the lake, its time does (1 GiB: some 25M events, 30 s of
# `stream_state`'s fold on two cores); past that a cluster's cores pay for a JVM's start.
SPARK_BYTES = 1024 * 1024 * 1024


def on_spark(engine: str, size: Callable[[], int]) -> bool:
    """The engine rule: `engine` "spark" always, "local" never, "auto" where the work's files (`size()`, asked only
    then) pass `SPARK_BYTES`."""
    if engine in ("spark", "local"):
        return engine == "spark"
    return size() > SPARK_BYTES
