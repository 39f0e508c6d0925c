"""The checks of `events`: no duplicates, contiguous versions, counts reconciled with the store.

In this process (DataFusion over the Delta table, Arrow; in bounded pieces) where the scope's files are within
the engine rule's bound, on Spark past it or where `ES_PIPELINE_ENGINE` says (`Engine.on_spark`): a range's
checks start no JVM.

Table-wide on their schedule (`lake_checks_job`, hourly) and from `es-pipeline lake check`. Run beside the
materialization of one partition (a hand materialization from the UI or `dagster asset materialize --partition`),
they check that partition's slices only (`Given.scope`), so that materializing a range costs what the range costs,
not what the table does: a stream lives in one slice, so every invariant holds per slice and a range's check is
exact for its streams. The outcome's `scope` says which it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, QueryBuilder

from es_pipeline.checks.check import Check, Given, Outcome
from es_pipeline.extraction import offsets
from es_pipeline.extraction.slices import NUM_SLICES, SliceRange
from es_pipeline.lake.delta import pieces, tables
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.source.mapping import NO_TENANT, Source, as_source
from es_pipeline.store import tenants
from es_pipeline.store.conninfo import connect

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def _lake(engine: Engine, warehouse: tables.Location, scope: SliceRange | None, *,
          version: int | None = None) -> _Events:
    """`events` (at `version`, default the newest), or the rows of the scope's slices (the files of other ranges
    are skipped by their slice statistics: a batch holds one range's slices), read where `engine` says
    (`Engine.on_spark`): in this process (DataFusion and Arrow, no JVM) unless the scope's files pass its bound."""
    path = EVENTS.path(warehouse)
    table = DeltaTable(path) if version is None else DeltaTable(path, version=version)

    size = tables.files_bytes(table) if scope is None else tables.files_bytes(table, "slice", scope.lo, scope.hi)
    if engine.on_spark(lambda: size):
        return _SparkEvents(engine.session(), path, scope, version)
    return _ArrowEvents(table, scope, pieces.count_for(size))


class _Events:
    """What the checks ask of `events` in their scope, by one engine."""

    engine = ""

    def duplicates(self) -> tuple[int, list[str]]:
        """How many (tenant, stream_id, version) appear twice or more, and a few as `stream@version`."""
        raise NotImplementedError

    def gaps(self, limit: int) -> list[str]:
        """Up to `limit` streams whose versions are not 1..n."""
        raise NotImplementedError

    def have(self, ids: list[str]) -> set[tuple[str, str, int]]:
        """The (tenant, stream_id, version) the lake holds of streams `ids`."""
        raise NotImplementedError

    def below(self, pending: list[int], marks: dict[int, int]) -> dict[int, int]:
        """Per slice with a watermark, the rows below it, pending batches' left out."""
        raise NotImplementedError

    def strays(self, pending: list[int], marks: dict[int, int], rebased: int | None, rebase_batch: int | None) -> int:
        """Rows at or above their slice's watermark outside a pending batch, the rebase's own left out."""
        raise NotImplementedError

    def tenants(self) -> dict[str, int]:
        """Events per tenant."""
        raise NotImplementedError


class _SparkEvents(_Events):
    engine = "spark"

    def __init__(self, spark: SparkSession, path: str, scope: SliceRange | None, version: int | None) -> None:
        self.spark = spark
        df = tables.with_tenant(tables.read(spark, path, version=version))
        self.df = df if scope is None else df.where(df.slice.between(scope.lo, scope.hi))

    def duplicates(self) -> tuple[int, list[str]]:
        dups = self.df.groupBy("tenant", "stream_id", "version").count().where("count > 1")
        return int(dups.count()), [f"{r['stream_id']}@{r['version']}" for r in dups.limit(5).collect()]

    def gaps(self, limit: int) -> list[str]:
        gaps = self.df.groupBy("tenant", "stream_id").agg({"version": "max", "stream_id": "count"}).where(
            "`max(version)` <> `count(stream_id)`").limit(limit).collect()
        return [r["stream_id"] for r in gaps]

    def have(self, ids: list[str]) -> set[tuple[str, str, int]]:
        return {(r["tenant"], r["stream_id"], r["version"]) for r in
                self.df.where(self.df.stream_id.isin(ids)).select("tenant", "stream_id", "version").collect()}

    def _beside(self, pending: list[int], marks: dict[int, int]) -> Any:
        rows = self.df.where(~self.df.batch_id.isin(pending)) if pending else self.df  # not counted on either side
        return rows.join(self.spark.createDataFrame(list(marks.items()), "slice INT, watermark BIGINT"), "slice")

    def below(self, pending: list[int], marks: dict[int, int]) -> dict[int, int]:
        counted = self._beside(pending, marks).where("tx_id < watermark").groupBy("slice").count().collect()
        return {int(r["slice"]): int(r["count"]) for r in counted}

    def strays(self, pending: list[int], marks: dict[int, int], rebased: int | None, rebase_batch: int | None) -> int:
        return int(self._beside(pending, marks).where(
            "tx_id >= watermark AND batch_id <> 0" + (f" AND tx_id >= {int(rebased)}" if rebased else "")
            + (f" AND batch_id <> {int(rebase_batch)}" if rebase_batch is not None else "")).count())

    def tenants(self) -> dict[str, int]:
        return {str(r["tenant"]): int(r["count"]) for r in self.df.groupBy("tenant").count().collect()}


class _ArrowEvents(_Events):
    """In this process: DataFusion's SQL over the Delta table (deletion vectors applied), Arrow for the rest. What
    groups by stream is asked a piece at a time (`count` spans of the scope's slices: a stream lives in one), what
    counts rows is streamed: memory for a piece, whatever `events`' size (lake/delta/pieces.py)."""

    engine = "local"

    def __init__(self, table: DeltaTable, scope: SliceRange | None, count: int = 1) -> None:
        self.table = table
        names = set(pa.schema(table.schema().to_arrow()).names)
        self.tenant = "coalesce(tenant, '')" if "tenant" in names else "''"
        lo, hi = (0, NUM_SLICES - 1) if scope is None else (scope.lo, scope.hi)
        self.frame = self._frame(None if scope is None else (lo, hi))
        n = max(1, min(count, hi - lo + 1))
        spans = [(lo + (hi + 1 - lo) * i // n, lo + (hi + 1 - lo) * (i + 1) // n - 1) for i in range(n)]
        self.frames = [self.frame] if n == 1 else [self._frame(span) for span in spans]

    def _frame(self, span: tuple[int, int] | None) -> str:
        where = "" if span is None else f" WHERE slice BETWEEN {int(span[0])} AND {int(span[1])}"
        return f'(SELECT {self.tenant} AS tenant, stream_id, "version", slice, tx_id, batch_id FROM events{where}) AS e'

    def _stream(self, query: str) -> pa.RecordBatchReader:
        return pa.RecordBatchReader.from_stream(QueryBuilder().register("events", self.table).execute(query))

    def _sql(self, query: str) -> pa.Table:
        return self._stream(query).read_all()

    def duplicates(self) -> tuple[int, list[str]]:
        count, some = 0, list[str]()
        for frame in self.frames:
            dups = self._sql(f'SELECT stream_id, "version" FROM {frame} GROUP BY tenant, stream_id, "version" '
                             "HAVING count(*) > 1")
            count += dups.num_rows
            some += [f"{r['stream_id']}@{r['version']}" for r in dups.slice(0, max(0, 5 - len(some))).to_pylist()]
        return count, some

    def gaps(self, limit: int) -> list[str]:
        found: list[str] = []
        for frame in self.frames:
            if len(found) >= limit:
                break
            rows = self._sql(f'SELECT stream_id FROM {frame} GROUP BY tenant, stream_id '
                             f'HAVING max("version") <> count(*) LIMIT {int(limit - len(found))}')
            found += [str(v) for v in rows["stream_id"].to_pylist()]
        return found

    def have(self, ids: list[str]) -> set[tuple[str, str, int]]:
        quoted = ", ".join("'" + i.replace("'", "''") + "'" for i in ids)
        found = self._sql(f'SELECT tenant, stream_id, "version" FROM {self.frame} WHERE stream_id IN ({quoted})')
        return {(r["tenant"], r["stream_id"], r["version"]) for r in found.to_pylist()}

    def _beside(self, pending: list[int], marks: dict[int, int]) -> Iterator[pa.Table]:
        """The scope's (slice, tx_id, batch_id, watermark) a batch at a time, pending batches' left out."""
        watermarks = pa.array([marks.get(i) for i in range(NUM_SLICES)], pa.int64())
        held = pa.array(pending, pa.int64())
        for batch in self._stream(f"SELECT slice, tx_id, batch_id FROM {self.frame}"):
            rows = pa.Table.from_batches([batch])
            if pending:  # not counted on either side
                rows = rows.filter(pc.invert(pc.fill_null(pc.is_in(rows["batch_id"], held), False)))
            rows = rows.append_column("watermark", watermarks.take(rows["slice"].cast(pa.int64())))
            yield rows.filter(pc.is_valid(rows["watermark"]))  # a slice without a watermark: joined to nothing

    def below(self, pending: list[int], marks: dict[int, int]) -> dict[int, int]:
        out: dict[int, int] = {}
        for rows in self._beside(pending, marks):
            counted = rows.filter(pc.less(rows["tx_id"], rows["watermark"])).group_by("slice").aggregate(
                [([], "count_all")])
            for s, n in zip(counted["slice"].to_pylist(), counted["count_all"].to_pylist(), strict=True):
                out[s] = out.get(s, 0) + n
        return out

    def strays(self, pending: list[int], marks: dict[int, int], rebased: int | None, rebase_batch: int | None) -> int:
        found = 0
        for rows in self._beside(pending, marks):
            keep = pc.and_(pc.greater_equal(rows["tx_id"], rows["watermark"]), pc.not_equal(rows["batch_id"], 0))
            if rebased:
                keep = pc.and_(keep, pc.greater_equal(rows["tx_id"], int(rebased)))
            if rebase_batch is not None:
                keep = pc.and_(keep, pc.not_equal(rows["batch_id"], int(rebase_batch)))
            found += int(pc.sum(pc.fill_null(keep, False).cast(pa.int64())).as_py() or 0)
        return found

    def tenants(self) -> dict[str, int]:
        found = self._sql(f"SELECT tenant, count(*) AS n FROM {self.frame} GROUP BY tenant")
        return {str(r["tenant"]): int(r["n"]) for r in found.to_pylist()}


def _scope_label(scope: SliceRange | None) -> str:
    return "every slice" if scope is None else f"slices {scope.key}"


def no_duplicates(given: Given) -> Outcome:
    lake = _lake(given.engine, given.warehouse, given.scope)
    n, sample = lake.duplicates()
    return Outcome(n == 0, {"duplicates": n, "examples": ", ".join(sample), "scope": _scope_label(given.scope),
                            "engine": lake.engine})


def versions_contiguous(given: Given) -> Outcome:
    lake = _lake(given.engine, given.warehouse, given.scope)
    ids = lake.gaps(10_000)
    if not ids:
        return Outcome(True, {"streams_with_gaps": 0, "scope": _scope_label(given.scope), "engine": lake.engine})
    with connect(given.store_dsn) as conn:
        due = offsets.events_below_watermarks(conn, given.source, given.source.consumer, ids)
    missing = sorted(set(due) - lake.have(ids))
    return Outcome(not missing, {
        "streams_with_gaps": len(ids), "missing_below_watermark": len(missing),
        "examples": ", ".join(f"{t + '/' if t else ''}{s}@{v}" for t, s, v in missing[:5]),
        "scope": _scope_label(given.scope), "engine": lake.engine})


def reconciled(given: Given) -> Outcome:
    return reconcile(given.engine, given.warehouse, given.store_dsn, given.source, given.scope)


@dataclass(frozen=True)
class _StoreView:
    """The offsets as of one snapshot of the store."""

    pending: list[int]
    marks: dict[int, int]
    counts: dict[int, int]  # events of the store below each slice's watermark
    rebased: int | None
    rebase_batch: int | None  # what a pending first run after the rebase wrote its rows as
    foreign: int  # events whose tx_id this cluster has not assigned yet (offsets.check_source)


def _store_view(dsn: str, source: Source, consumer: str, slices: list[int] | None) -> _StoreView:
    with connect(dsn) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ  # every read below sees one snapshot
        with conn.transaction():
            return _StoreView(
                pending=offsets.pending_batch_ids(conn, consumer),
                marks=offsets.read_watermarks(conn, consumer, range(NUM_SLICES) if slices is None else slices),
                counts=offsets.counts_below_watermarks(conn, source, consumer, slices),
                rebased=offsets.rebased_below(conn, consumer),
                rebase_batch=offsets.rebase_batch(conn, consumer),
                foreign=offsets.events_from_another_cluster(conn, source, consumer),
            )


def reconcile(
    engine: Engine, warehouse: tables.Location, dsn: str, source: Source | str, scope: SliceRange | None, *,
    between: Callable[[str], None] | None = None,
) -> Outcome:
    """The lake against the store, while runs go on extracting.

    The store is read twice, before (S1) and after (S2) the lake's version is fixed: every batch whose
    watermarks had advanced at S1 is in that version (a batch is committed to Delta before its offsets), so
    the counts below S1's watermarks must be equal; and every batch in that version is, at S2, either below
    S2's watermarks or still pending, so a row above S2's watermarks outside a pending batch is a stray.
    `between` (tests) runs at `"lake"` (after S1) and `"after"` (after the version is fixed). Spark is
    started only where `engine` and the scope's size say Spark (`_lake`).
    """
    source = as_source(source)
    consumer = source.consumer
    path = EVENTS.path(warehouse)
    slices = None if scope is None else scope.slices
    before = _store_view(dsn, source, consumer, slices)
    if between is not None:
        between("lake")
    version = DeltaTable(path).version()
    if between is not None:
        between("after")
    after = _store_view(dsn, source, consumer, slices)
    lake = _lake(engine, warehouse, scope, version=version)
    lake_counts = lake.below(before.pending, before.marks)
    # Above a watermark the lake holds nothing, but the restored events a rebase brought early (batch 0 before this
    # release, its own batch since), a pending first run after it (the rebase's batch too) and, until the new
    # cluster's ids pass them, the events extracted before it (ids of the old cluster).
    n_stray = lake.strays(after.pending, after.marks, after.rebased, after.rebase_batch)
    store_counts = before.counts
    lost = _lost_tenants(lake, dsn, source)
    pairs = {s: (store_counts.get(s, 0), lake_counts.get(s, 0)) for s in set(store_counts) | set(lake_counts)}
    # A framework that deletes events (`deletes_events`: Pekko's deleteEventsTo) leaves the lake holding more than
    # the store: only fewer is a loss; the excess is said, as what cannot be checked (duplicates have their check).
    off = {s: (a, b) for s, (a, b) in pairs.items() if (b < a if source.deletes_events else a != b)}
    deleted = sum(b - a for a, b in pairs.values() if b > a) if source.deletes_events else 0
    return Outcome(
        not off and n_stray == 0 and not lost and not before.foreign,
        {"slices_checked": len(store_counts), "slices_off": len(off), "above_watermark": n_stray,
                  # Rows another cluster wrote hide above the horizon, beyond every count: `offsets rebase`.
                  "events_from_another_cluster": before.foreign,
                  **({"deleted_by_the_framework_unchecked": deleted} if source.deletes_events else {}),
                  "source_events": int(sum(store_counts.values())), "lake_events": int(sum(lake_counts.values())),
                  "lake_version": int(version),
                  "examples": ", ".join(f"slice {s}: source {a}, lake {b}" for s, (a, b) in sorted(off.items())[:5]),
                  "tenants_lost": ", ".join(f"{t} ({n} events; dropped outside `tenant erase`)" for t, n in lost.items()),
                  "scope": _scope_label(scope), "engine": lake.engine},
    )


def _lost_tenants(lake: _Events, dsn: str, source: Source) -> dict[str, int]:
    """Tenants the lake holds (in the check's scope) whose events left the store without `tenant erase`."""
    if source.tenant == NO_TENANT:
        return {}
    counts = lake.tenants()
    with connect(dsn) as conn:
        return tenants.missing(conn, source, counts)


CHECKS = [
    Check("events_no_duplicates", "events", "No (tenant, stream_id, version) appears twice in the lake.",
          no_duplicates, blocking=True, scoped=True),
    Check("events_versions_contiguous", "events",
          "Versions are contiguous from 1 per stream. A gap passes only while the missing event is still above its "
          "slice's watermark in Postgres (committed out of xid order, on its way).",
          versions_contiguous, blocking=True, scoped=True),
    Check("events_reconcile_with_source", "events",
          "Per slice, the lake holds exactly as many events below the slice's watermark as Postgres does, and none "
          "above it but a pending batch's (or, after a rebase, restored ones).",
          reconciled, blocking=True, scoped=True),
]
