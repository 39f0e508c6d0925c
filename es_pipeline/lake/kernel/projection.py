"""`Projection`: what a kind of table built from `events` gives the runner (lake/kernel/runner.py), and nothing of the
bookkeeping: its table and the columns of `events` it reads, how a change-feed increment folds onto its rows, its
whole build in process and its update on Spark. The runner owns the position, the turn, the engine and the commit.

Moved to it so far (decision 0049): the aggregates (lake/aggregates/aggregate.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable

from es_pipeline.lake.delta.definition import Table
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.kernel.result import Result
from es_pipeline.lake.kernel.turn import Turn


class Folded(Protocol):
    """An increment folded, to be committed with the position (`commit`), and its figures."""

    @property
    def figures(self) -> Mapping[str, int | str | bool]: ...

    def commit(self, target: DeltaTable, properties: CommitProperties) -> None:
        """Write the folded rows into `target` in one commit that carries `properties` (the position); with no rows,
        the position alone (an empty commit)."""


class Projection(Protocol):
    @property
    def table(self) -> Table: ...

    @property
    def name(self) -> str: ...

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns of `events` its fold reads."""

    def continues(self, target: DeltaTable) -> bool:
        """Whether an increment may fold onto `target` as it is (else it is built whole: a table of an older release)."""

    def fold(self, rows: pa.Table) -> Folded:
        """The increment `rows` (the change feed's, in `columns`) folded, ready to commit onto the table."""

    def build_here(self, warehouse: Location, turn: Turn, engine: str) -> Result | None:
        """A whole build in this process, where the engine rule says (else None: Spark's), or None when the table
        was built from this `events` already (an increment the runner left to Spark)."""

    def update_on_spark(self, spark: Any, warehouse: Location, turn: Turn) -> Result:
        """The update on Spark: the increment, or the whole build."""
