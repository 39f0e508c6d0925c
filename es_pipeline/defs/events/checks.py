"""Table-wide checks of `events`: no duplicates, contiguous versions, counts reconcile with the store."""

import dagster as dg

from es_pipeline.defs.resources import EventStoreResource, SparkResource, WarehouseResource
from es_pipeline.extraction import offsets
from es_pipeline.extraction.offsets import events_consumer
from es_pipeline.extraction.slices import NUM_SLICES
from es_pipeline.lake import tables
from es_pipeline.store.conninfo import connect


@dg.asset_check(asset="events", blocking=True, description="No (stream_id, version) appears twice in the lake.")
def events_no_duplicates(spark: SparkResource, warehouse: WarehouseResource) -> dg.AssetCheckResult:
    df = tables.read(spark.spark_session, tables.table_path(warehouse.root, "events"))
    dups = df.groupBy("stream_id", "version").count().where("count > 1")
    n = int(dups.count())
    sample = [f"{r['stream_id']}@{r['version']}" for r in dups.limit(5).collect()]
    return dg.AssetCheckResult(passed=n == 0, metadata={"duplicates": n, "examples": ", ".join(sample)})


@dg.asset_check(
    asset="events", blocking=True,
    description="Versions are contiguous from 1 per stream. A gap passes only while the missing event "
    "is still above its slice's watermark in Postgres (committed out of xid order, on its way).",
)
def events_versions_contiguous(
    spark: SparkResource, warehouse: WarehouseResource, event_store: EventStoreResource
) -> dg.AssetCheckResult:
    df = tables.read(spark.spark_session, tables.table_path(warehouse.root, "events"))
    gaps = df.groupBy("stream_id").agg({"version": "max", "stream_id": "count"}).where(
        "`max(version)` <> `count(stream_id)`"
    ).limit(10_000).collect()
    if not gaps:
        return dg.AssetCheckResult(passed=True, metadata={"streams_with_gaps": 0})
    ids = [r["stream_id"] for r in gaps]
    consumer = events_consumer(event_store.schema_name)
    with connect(event_store.dsn) as conn:
        due = offsets.events_below_watermarks(conn, event_store.schema_name, consumer, ids)
    have = {(r["stream_id"], r["version"]) for r in df.where(df.stream_id.isin(ids)).select("stream_id", "version").collect()}
    missing = sorted(set(due) - have)
    return dg.AssetCheckResult(
        passed=not missing,
        metadata={"streams_with_gaps": len(ids), "missing_below_watermark": len(missing),
                  "examples": ", ".join(f"{s}@{v}" for s, v in missing[:5])},
    )


@dg.asset_check(
    asset="events", blocking=True,
    description="Per slice, the lake holds exactly as many events below the slice's watermark as Postgres does, "
    "and none above it but a pending batch's (or, after a rebase, restored ones).",
)
def events_reconcile_with_source(
    spark: SparkResource, warehouse: WarehouseResource, event_store: EventStoreResource
) -> dg.AssetCheckResult:
    consumer = events_consumer(event_store.schema_name)
    with connect(event_store.dsn) as conn:
        pending = offsets.pending_batch_ids(conn, consumer)
        source = offsets.counts_below_watermarks(conn, event_store.schema_name, consumer)
        marks = offsets.read_watermarks(conn, consumer, range(NUM_SLICES))
        rebased = offsets.rebased_below(conn, consumer)
    session = spark.spark_session
    df = tables.read(session, tables.table_path(warehouse.root, "events"))
    if pending:  # rows of a batch whose offsets did not commit yet (a crash): not counted on either side
        df = df.where(~df.batch_id.isin(pending))
    df = df.join(session.createDataFrame(list(marks.items()), "slice INT, watermark BIGINT"), "slice")
    lake_counts = {int(r["slice"]): int(r["count"]) for r in df.where("tx_id < watermark").groupBy("slice").count().collect()}
    # Above a watermark the lake holds nothing, but restored events a rebase brought early (batch 0), and,
    # until the new cluster's ids pass them, the events extracted before it (ids of the old cluster).
    stray = df.where("tx_id >= watermark AND batch_id <> 0" + (f" AND tx_id >= {int(rebased)}" if rebased else ""))
    n_stray = int(stray.count())
    off = {s: (source.get(s, 0), lake_counts.get(s, 0)) for s in set(source) | set(lake_counts)
           if source.get(s, 0) != lake_counts.get(s, 0)}
    return dg.AssetCheckResult(
        passed=not off and n_stray == 0,
        metadata={"slices_checked": len(source), "slices_off": len(off), "above_watermark": n_stray,
                  "source_events": int(sum(source.values())), "lake_events": int(sum(lake_counts.values())),
                  "examples": ", ".join(f"slice {s}: source {a}, lake {b}" for s, (a, b) in sorted(off.items())[:5])},
    )


CHECKS = [events_no_duplicates, events_versions_contiguous, events_reconcile_with_source]
