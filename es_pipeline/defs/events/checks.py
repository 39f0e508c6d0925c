"""Checks of `events`: no duplicates, contiguous versions, counts reconcile with the store.

Table-wide on their schedule (`lake_checks_job`, hourly). Run beside the materialization of one
partition (a hand materialization from the UI or `dagster asset materialize --partition`), they check
that partition's slices only, so that materializing a range costs what the range costs, not what the
table does: a stream lives in one slice, so every invariant holds per slice and a range's check is
exact for its streams. The result's `scope` says which it was.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dagster as dg
import psycopg
from dagster._core.errors import DagsterInvalidPropertyError
from deltalake import DeltaTable

from es_pipeline.defs.resources import EventStoreResource, SparkResource, WarehouseResource
from es_pipeline.extraction import offsets
from es_pipeline.extraction.slices import NUM_SLICES, SliceRange
from es_pipeline.lake.delta import tables
from es_pipeline.lake.events import EVENTS
from es_pipeline.source.mapping import NO_TENANT, Source, as_source
from es_pipeline.store import tenants
from es_pipeline.store.conninfo import connect

PARTITION_TAG = "dagster/partition"


def scope_of(context: dg.AssetCheckExecutionContext | None) -> SliceRange | None:
    """The slice range of the partition this check runs beside, or None (the whole table)."""
    try:
        key = context.run.tags.get(PARTITION_TAG) if context is not None else None
    except DagsterInvalidPropertyError:  # invoked directly, outside a run: the whole table
        key = None
    return SliceRange.from_key(key) if key else None


def _lake(spark: Any, warehouse: tables.Location, scope: SliceRange | None, *, version: int | None = None) -> Any:
    """The `events` table (at `version`, default the newest), or the rows of the scope's slices (the files of
    other ranges are skipped by their slice statistics: a batch holds one range's slices)."""
    df = tables.with_tenant(tables.read(spark, EVENTS.path(warehouse), version=version))
    return df if scope is None else df.where(df.slice.between(scope.lo, scope.hi))


def _scope_label(scope: SliceRange | None) -> str:
    return "every slice" if scope is None else f"slices {scope.key}"


@dg.asset_check(asset="events", blocking=True, description="No (tenant, stream_id, version) appears twice in the lake.")
def events_no_duplicates(
    context: dg.AssetCheckExecutionContext, spark: SparkResource, warehouse: WarehouseResource
) -> dg.AssetCheckResult:
    scope = scope_of(context)
    df = _lake(spark.spark_session, warehouse.root, scope)
    dups = df.groupBy("tenant", "stream_id", "version").count().where("count > 1")
    n = int(dups.count())
    sample = [f"{r['stream_id']}@{r['version']}" for r in dups.limit(5).collect()]
    return dg.AssetCheckResult(passed=n == 0, metadata={"duplicates": n, "examples": ", ".join(sample),
                                                         "scope": _scope_label(scope)})


@dg.asset_check(
    asset="events", blocking=True,
    description="Versions are contiguous from 1 per stream. A gap passes only while the missing event "
    "is still above its slice's watermark in Postgres (committed out of xid order, on its way).",
)
def events_versions_contiguous(
    context: dg.AssetCheckExecutionContext, spark: SparkResource, warehouse: WarehouseResource,
    event_store: EventStoreResource,
) -> dg.AssetCheckResult:
    scope = scope_of(context)
    df = _lake(spark.spark_session, warehouse.root, scope)
    gaps = df.groupBy("tenant", "stream_id").agg({"version": "max", "stream_id": "count"}).where(
        "`max(version)` <> `count(stream_id)`"
    ).limit(10_000).collect()
    if not gaps:
        return dg.AssetCheckResult(passed=True, metadata={"streams_with_gaps": 0, "scope": _scope_label(scope)})
    ids = [r["stream_id"] for r in gaps]
    source = event_store.events_source()
    with connect(event_store.dsn) as conn:
        due = offsets.events_below_watermarks(conn, source, source.consumer, ids)
    have = {(r["tenant"], r["stream_id"], r["version"])
            for r in df.where(df.stream_id.isin(ids)).select("tenant", "stream_id", "version").collect()}
    missing = sorted(set(due) - have)
    return dg.AssetCheckResult(
        passed=not missing,
        metadata={"streams_with_gaps": len(ids), "missing_below_watermark": len(missing),
                  "examples": ", ".join(f"{t + '/' if t else ''}{s}@{v}" for t, s, v in missing[:5]),
                  "scope": _scope_label(scope)},
    )


@dg.asset_check(
    asset="events", blocking=True,
    description="Per slice, the lake holds exactly as many events below the slice's watermark as Postgres does, "
    "and none above it but a pending batch's (or, after a rebase, restored ones).",
)
def events_reconcile_with_source(
    context: dg.AssetCheckExecutionContext, spark: SparkResource, warehouse: WarehouseResource,
    event_store: EventStoreResource,
) -> dg.AssetCheckResult:
    scope = scope_of(context)
    return reconcile(spark.spark_session, warehouse.root, event_store.dsn, event_store.events_source(), scope)


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
    spark: Any, warehouse: tables.Location, dsn: str, source: Source | str, scope: SliceRange | None, *,
    between: Callable[[str], None] | None = None,
) -> dg.AssetCheckResult:
    """The lake against the store, while runs go on extracting.

    The store is read twice, before (S1) and after (S2) the lake's version is fixed: every batch whose
    watermarks had advanced at S1 is in that version (a batch is committed to Delta before its offsets), so
    the counts below S1's watermarks must be equal; and every batch in that version is, at S2, either below
    S2's watermarks or still pending, so a row above S2's watermarks outside a pending batch is a stray.
    `between` (tests) runs at `"lake"` (after S1) and `"after"` (after the version is fixed).
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
    df = _lake(spark, warehouse, scope, version=version)

    def beside(view: _StoreView) -> Any:
        rows = df.where(~df.batch_id.isin(view.pending)) if view.pending else df  # not counted on either side
        return rows.join(spark.createDataFrame(list(view.marks.items()), "slice INT, watermark BIGINT"), "slice")

    below = beside(before).where("tx_id < watermark").groupBy("slice").count().collect()
    lake_counts = {int(r["slice"]): int(r["count"]) for r in below}
    # Above a watermark the lake holds nothing, but the restored events a rebase brought early (batch 0 before this
    # release, its own batch since), a pending first run after it (the rebase's batch too) and, until the new
    # cluster's ids pass them, the events extracted before it (ids of the old cluster).
    rebased = after.rebased
    n_stray = int(beside(after).where(
        "tx_id >= watermark AND batch_id <> 0" + (f" AND tx_id >= {int(rebased)}" if rebased else "")
        + (f" AND batch_id <> {int(after.rebase_batch)}" if after.rebase_batch is not None else "")).count())
    store_counts = before.counts
    lost = _lost_tenants(df, dsn, source)
    pairs = {s: (store_counts.get(s, 0), lake_counts.get(s, 0)) for s in set(store_counts) | set(lake_counts)}
    # A framework that deletes events (`deletes_events`: Pekko's deleteEventsTo) leaves the lake holding more than
    # the store: only fewer is a loss; the excess is said, as what cannot be checked (duplicates have their check).
    off = {s: (a, b) for s, (a, b) in pairs.items() if (b < a if source.deletes_events else a != b)}
    deleted = sum(b - a for a, b in pairs.values() if b > a) if source.deletes_events else 0
    return dg.AssetCheckResult(
        passed=not off and n_stray == 0 and not lost and not before.foreign,
        metadata={"slices_checked": len(store_counts), "slices_off": len(off), "above_watermark": n_stray,
                  # Rows another cluster wrote hide above the horizon, beyond every count: `offsets rebase`.
                  "events_from_another_cluster": before.foreign,
                  **({"deleted_by_the_framework_unchecked": deleted} if source.deletes_events else {}),
                  "source_events": int(sum(store_counts.values())), "lake_events": int(sum(lake_counts.values())),
                  "lake_version": int(version),
                  "examples": ", ".join(f"slice {s}: source {a}, lake {b}" for s, (a, b) in sorted(off.items())[:5]),
                  "tenants_lost": ", ".join(f"{t} ({n} events; dropped outside `tenant erase`)" for t, n in lost.items()),
                  "scope": _scope_label(scope)},
    )


def _lost_tenants(df: Any, dsn: str, source: Source) -> dict[str, int]:
    """Tenants the lake holds (in the check's scope) whose events left the store without `tenant erase`."""
    if source.tenant == NO_TENANT:
        return {}
    counts = {str(r["tenant"]): int(r["count"]) for r in df.groupBy("tenant").count().collect()}
    with connect(dsn) as conn:
        return tenants.missing(conn, source, counts)


CHECKS = [events_no_duplicates, events_versions_contiguous, events_reconcile_with_source]
