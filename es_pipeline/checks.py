"""Asset checks on `events` and `stream_state` (DESIGN §4): invariants, computed over the whole table."""

import dagster as dg

from es_pipeline import lake
from es_pipeline.extract import EVENTS_CONSUMER
from es_pipeline.pg import connect
from es_pipeline.resources import EventStoreResource, SparkResource, WarehouseResource


@dg.asset_check(asset="events", blocking=True, description="No (stream_id, version) appears twice in the lake.")
def events_no_duplicates(spark: SparkResource, warehouse: WarehouseResource) -> dg.AssetCheckResult:
    df = spark.spark_session.read.format("delta").load(lake.table_path(warehouse.root, "events"))
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
    df = spark.spark_session.read.format("delta").load(lake.table_path(warehouse.root, "events"))
    gaps = df.groupBy("stream_id").agg({"version": "max", "stream_id": "count"}).where(
        "`max(version)` <> `count(stream_id)`"
    ).limit(10_000).collect()
    if not gaps:
        return dg.AssetCheckResult(passed=True, metadata={"streams_with_gaps": 0})
    ids = [r["stream_id"] for r in gaps]
    with connect(event_store.dsn) as conn:
        due = conn.execute(
            f"SELECT e.stream_id, e.version FROM {event_store.schema_name}.events e "  # type: ignore[arg-type]
            "LEFT JOIN es_pipeline.offsets o ON o.consumer = %s AND o.slice = e.slice "
            "WHERE e.stream_id = ANY(%s) AND e.tx_id < coalesce(o.watermark, '0'::xid8)",
            (EVENTS_CONSUMER, ids),
        ).fetchall()
    have = {(r["stream_id"], r["version"]) for r in df.where(df.stream_id.isin(ids)).select("stream_id", "version").collect()}
    missing = sorted(set(due) - have)
    return dg.AssetCheckResult(
        passed=not missing,
        metadata={"streams_with_gaps": len(ids), "missing_below_watermark": len(missing),
                  "examples": ", ".join(f"{s}@{v}" for s, v in missing[:5])},
    )


@dg.asset_check(
    asset="events", blocking=True,
    description="Per slice, the lake holds exactly as many events as Postgres has below the slice's watermark.",
)
def events_reconcile_with_source(
    spark: SparkResource, warehouse: WarehouseResource, event_store: EventStoreResource
) -> dg.AssetCheckResult:
    with connect(event_store.dsn) as conn:
        pending = [r[0] for r in conn.execute(
            "SELECT batch_id FROM es_pipeline.pending_batches WHERE consumer = %s", (EVENTS_CONSUMER,))]
        source: dict[int, int] = dict(conn.execute(
            f"SELECT o.slice, count(e.*) FROM es_pipeline.offsets o LEFT JOIN {event_store.schema_name}.events e "  # type: ignore[arg-type]
            "ON e.slice = o.slice AND e.tx_id < o.watermark WHERE o.consumer = %s GROUP BY o.slice",
            (EVENTS_CONSUMER,),
        ).fetchall())
    df = spark.spark_session.read.format("delta").load(lake.table_path(warehouse.root, "events"))
    if pending:  # rows of a batch whose offsets did not commit yet (a crash): not counted on either side
        df = df.where(~df.batch_id.isin(pending))
    lake_counts = {int(r["slice"]): int(r["count"]) for r in df.groupBy("slice").count().collect()}
    off = {s: (source.get(s, 0), lake_counts.get(s, 0)) for s in set(source) | set(lake_counts)
           if source.get(s, 0) != lake_counts.get(s, 0)}
    return dg.AssetCheckResult(
        passed=not off,
        metadata={"slices_checked": len(source), "slices_off": len(off),
                  "source_events": int(sum(source.values())), "lake_events": int(sum(lake_counts.values())),
                  "examples": ", ".join(f"slice {s}: source {a}, lake {b}" for s, (a, b) in sorted(off.items())[:5])},
    )


@dg.asset_check(
    asset="stream_state", blocking=True,
    description="Each stream's folded version equals its max version in `events` (unless events wait, parked, for a gap).",
)
def stream_state_version_matches_events(spark: SparkResource, warehouse: WarehouseResource) -> dg.AssetCheckResult:
    s = spark.spark_session
    events = s.read.format("delta").load(lake.table_path(warehouse.root, "events")).groupBy("stream_id").agg(
        {"version": "max"}).withColumnRenamed("max(version)", "max_version")
    state = s.read.format("delta").load(lake.table_path(warehouse.root, "stream_state"))
    bad = state.join(events, "stream_id", "full_outer").where(
        "parked IS NULL AND (version IS NULL OR max_version IS NULL OR version <> max_version)")
    n = int(bad.count())
    return dg.AssetCheckResult(
        passed=n == 0,
        metadata={"streams_off": n, "examples": ", ".join(r["stream_id"] for r in bad.limit(5).collect())},
    )


CHECKS = [events_no_duplicates, events_versions_contiguous, events_reconcile_with_source,
          stream_state_version_matches_events]
