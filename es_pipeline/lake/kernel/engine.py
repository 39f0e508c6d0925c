"""The engine rule: where a table's work runs, in this process (pyarrow, DuckDB, delta-rs: no JVM) or on Spark.

One rule for every table and check (docs/architecture.md, "Engines"), held by one value, `Engine`: the setting
(`ES_PIPELINE_ENGINE`: "spark" always, "local" never, "auto" where the work's files pass `SPARK_BYTES`), the Spark
session to use where the rule says Spark (or a function that makes it, called only then), and whether increments
(a few commits of the change feed, up to `feed.SMALL_INCREMENT` events) run in process. A table's entry point makes
one `Engine` from what its caller gives; below it, the runner and the kinds ask it, and no module decides again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# `events` Parquet files above which `auto` does the work on Spark. In process it is read in bounded pieces
# (lake/delta/pieces.py): its memory does not grow with the lake, its time does (1 GiB: some 25M events, 30 s of
# `stream_state`'s fold on two cores); past that a cluster's cores pay for a JVM's start.
SPARK_BYTES = 1024 * 1024 * 1024

SETTINGS = ("auto", "local", "spark")


def on_spark(engine: str, size: Callable[[], int]) -> bool:
    """The engine rule: `engine` "spark" always, "local" never, "auto" where the work's files (`size()`, asked only
    then) pass `SPARK_BYTES`."""
    if engine in ("spark", "local"):
        return engine == "spark"
    return size() > SPARK_BYTES


@dataclass(frozen=True)
class Engine:
    """Where a table's work runs: `setting` ("auto", "local" or "spark"), with `spark` (a session, or a function that
    returns one, called only where Spark is needed; None: there is no Spark here, everything runs in process), and
    `small_increments` (False: even a small increment runs on Spark, as a test of the Spark path asks)."""

    setting: str = "auto"
    spark: Any = None
    small_increments: bool = True

    def __post_init__(self) -> None:
        if self.setting not in SETTINGS:
            raise ValueError(f"engine {self.setting!r}: it is one of {', '.join(SETTINGS)} (ES_PIPELINE_ENGINE)")

    @property
    def increments_here(self) -> bool:
        """Whether an increment runs in this process (else on Spark)."""
        return self.small_increments and self.setting != "spark"

    @property
    def has_spark(self) -> bool:
        return self.spark is not None

    def on_spark(self, size: Callable[[], int]) -> bool:
        """The rule for whole work over files of `size()` bytes (asked only where it matters): Spark's by the setting,
        never where there is no Spark."""
        return self.has_spark and on_spark(self.setting, size)

    def session(self) -> SparkSession:
        """The Spark session (made now where `spark` is a function that makes it)."""
        if self.spark is None:
            raise ValueError("this work needs Spark and was given none: give the table's update a Spark session")
        return self.spark() if callable(self.spark) else self.spark


HERE = Engine()  # no Spark: everything in this process
