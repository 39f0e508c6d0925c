"""The `stream_state` table and the fold onto its rows, shared by its live updates (lake/state/stream_state.py)
and the rebuilds beside it (lake/state/rebuild.py): its definition and app id, the fold of new events onto
prior rows in this process (`fold_onto`), and the same on Spark (`spark_columns`, `spark_fold`); and its
quarantined rows into `_dead_letters` (`follow_dead_letters`)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from es_pipeline.domain import Domain
from es_pipeline.lake.delta.definition import Table, spark_type
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.kernel import dead_letters
from es_pipeline.lake.state.fold import FOLD_OUT, STATE_SCHEMA, fold_input, fold_partitions

# Keyed by (tenant, stream_id); `tenant` last, where a table of a release before tenants takes it.
STREAM_STATE = Table("stream_state", STATE_SCHEMA, key=("tenant", "stream_id"), comment="current state per stream")
KEY = STREAM_STATE.key
FOLD_OUT_DDL = ", ".join(f"{f.name} {spark_type(f.type)}" for f in FOLD_OUT)


def app_id(events_id: str) -> str:
    """The app id of `stream_state`'s commits folded from the `events` table of Delta id `events_id`."""
    return STREAM_STATE.app_id_over(events_id)


def fold_onto(whole: pa.Table, new: pa.Table, domain: Domain, skip_unknown: bool) -> tuple[pa.Table, pa.Table]:
    """`new` events (as reducers read them) folded onto the rows of `whole` (a `stream_state` table's, read whole)
    of the streams they touch, with every parked row: (the fold's output, `FOLD_OUT`; the prior rows it read)."""
    prior = whole.filter(pc.or_(pc.is_in(whole["stream_id"], pc.unique(new["stream_id"])),
                                pc.is_valid(whole["parked"])))
    rows = fold_input(new, prior)
    out = pa.Table.from_batches(list(fold_partitions(dict(domain.folds), skip_unknown, domain.quarantines)(
                                    rows.to_batches())),
                                schema=FOLD_OUT)
    return out, prior


def spark_columns(domain: Domain) -> list[Any]:
    """`events`' columns as the fold reads them, on Spark: payloads as reducers read them (JSON as is, base64 or text
    wrapped as {"base64": …}, source/payloads.py), event types with their schema version where the domain reads it
    from metadata (as `Domain.versioned_type` makes it), tenant filled."""
    from pyspark.sql import functions as F

    enc = F.col("payload_encoding")
    field = domain.metadata_field
    held = None if field is None else F.get_json_object("metadata", "$['" + field.replace("'", "") + "']")
    event_type = F.col("event_type") if held is None else F.concat(
        F.col("event_type"), F.lit(".v"), F.greatest(F.lit(1), F.when(
            held.rlike("^[0-9]{1,18}$"), held.cast("long")).otherwise(F.lit(1))).cast("string"))
    return ["stream_id", "stream_type", "version", event_type.alias("event_type"),
            F.when(enc.isNull() | (enc == "json"), F.col("payload"))
            .otherwise(F.to_json(F.create_map(enc, F.col("payload")))).alias("payload"), "recorded_at",
            F.coalesce(F.col("tenant"), F.lit("")).alias("tenant")]


def spark_fold(rows: Any, domain: Domain, skip_unknown: bool) -> Any:
    """The fold on Spark of `rows` (new events in `spark_columns`, and prior rows marked `is_prior` with their
    `prior_*` columns): partitioned by stream, sorted prior first then by version, folded by `fold_partitions` on
    the Python workers. A DataFrame of `FOLD_OUT`."""
    from pyspark.sql import functions as F

    return (rows.repartition(*KEY)
            .sortWithinPartitions(*KEY, F.col("is_prior").desc(), "version")
            .mapInArrow(fold_partitions(dict(domain.folds), skip_unknown, domain.quarantines), FOLD_OUT_DDL))


def without_prior(events: Any) -> Any:
    """Events (in `spark_columns`) as `spark_fold` takes them where no stream has a prior row."""
    from pyspark.sql import functions as F

    return events.withColumn("prior_skipped", F.lit(None).cast("int")).withColumn("is_prior", F.lit(False)) \
        .withColumn("prior_history_from", F.lit(None).cast("int")) \
        .withColumn("prior_history_at", F.lit(None).cast("timestamp")) \
        .withColumn("prior_quarantined", F.lit(None).cast("string"))


def follow_dead_letters(warehouse: Location, held: pa.Table | None = None) -> None:
    """`_dead_letters`' rows of `stream_state` made its quarantined rows as it stands (lake/kernel/dead_letters.py):
    `held` where the caller knows them, else read where `stream_state` moved since they were written."""
    dead_letters.follow(warehouse, STREAM_STATE.name, "stream_id", held=held)
