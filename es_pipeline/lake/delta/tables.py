"""The Delta tables under the warehouse: paths, schemas, creation, reads, idempotent writes.

Every Delta read and write of es_pipeline goes through here, with Spark or with delta-rs. The
tables and what each holds: docs/architecture.md ("The lake").

The warehouse is a local folder or a URI (`s3://bucket/prefix`): what this module reads of a table's
files (its log) goes through a pyarrow filesystem, which takes an S3 endpoint and keys from the
standard AWS variables, as delta-rs does.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from deltalake import CommitProperties, DeltaTable, Field
from deltalake.exceptions import CommitFailedError

from es_pipeline import domain
from es_pipeline.errors import LakeHoldsAnotherSource, NoEventsYet

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

UTC_MICROS = domain.UTC_MICROS  # a moment, as every table here holds it (Delta's TIMESTAMP)

TABLES = domain.TABLES  # es_pipeline's own tables (the typed ones besides)


Location = Path | str  # a local folder, or a URI such as s3://bucket/prefix


def is_uri(location: Location) -> bool:
    return "://" in str(location)


def without_scheme(uri: str) -> str:
    """A file's URI as pyarrow's filesystems name it (`s3://bucket/key` → `bucket/key`; a local path as it is)."""
    return uri.split("://", 1)[1] if is_uri(uri) else uri


def table_path(warehouse: Location, name: str) -> str:
    w = str(warehouse)
    return f"{w.rstrip('/')}/{name}" if is_uri(w) else str(Path(w) / name)


def remove_folder(location: Location) -> None:
    """A folder and everything in it (a local folder or an object store's prefix), if there."""
    fs, root = filesystem(location)
    try:
        fs.delete_dir(root)
    except FileNotFoundError:
        pass


def filesystem(location: Location) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem of a location, and the location's path in it."""
    if is_uri(location):
        return pafs.FileSystem.from_uri(str(location))
    return pafs.LocalFileSystem(), str(location)


def _log_names(path: str) -> list[str]:
    """The file names in the table's `_delta_log` (none when it does not exist)."""
    fs, root = filesystem(path)
    try:
        listed = fs.get_file_info(pafs.FileSelector(f"{root}/_delta_log", allow_not_found=True))
    except FileNotFoundError:  # seen while another process creates the table: the folder comes and goes
        return []
    return [info.base_name for info in listed if info.type == pafs.FileType.File]


def table_names(warehouse: Location, prefix: str) -> list[str]:
    """The Delta tables directly under the warehouse whose names begin with `prefix`, sorted."""
    fs, root = filesystem(warehouse)
    try:
        listed = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except FileNotFoundError:
        return []
    names = sorted(i.base_name for i in listed if i.type == pafs.FileType.Directory and i.base_name.startswith(prefix))
    return [n for n in names if is_delta_table(table_path(warehouse, n))]


def is_delta_table(path: str) -> bool:
    """A Delta table exists once its first commit file does (a killed creator can leave an empty log)."""
    return any(name.endswith(".json") for name in _log_names(path))




def ensure_table(
    spark: SparkSession, path: str, ddl: str, *, comment: str = "", properties: dict[str, str] | None = None
) -> None:
    """Create an empty Delta table with `ddl` if none is there. Safe when two processes race.

    Plain SQL, like every Delta operation here, so that it runs the same on a classic session and
    on a Spark Connect one.
    """
    if is_delta_table(path):
        return
    props = ", ".join(f"'{k}' = '{v}'" for k, v in (properties or {}).items())
    statement = (
        f"CREATE TABLE IF NOT EXISTS delta.`{path}` ({ddl}) USING delta"
        + (f" COMMENT '{comment}'" if comment else "")
        + (f" TBLPROPERTIES ({props})" if props else "")
    )
    try:
        spark.sql(statement)
    except Exception:  # noqa: BLE001 - a concurrent creator won; anything else re-raises
        if not is_delta_table(path):
            raise


def read(spark: SparkSession, path: str, *, version: int | None = None) -> Any:
    """A Delta table as a Spark DataFrame: its latest version, or `version` (time travel)."""
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    return reader.load(path)


SOURCE_PROPERTY = "es_pipeline.source"  # on `events`: `<store id>/<consumer>`, the one source the lake holds


def check_source(table: DeltaTable, path: str, source: str, consumer: str) -> bool:
    """Whether the `events` table (`table`, at `path`) is bound to `source`; False: to none yet (a table of an older
    release); `LakeHoldsAnotherSource` if to another."""
    held = table.metadata().configuration.get(SOURCE_PROPERTY)
    if held is not None and held != source:
        raise LakeHoldsAnotherSource(path, consumer, None, bound_to=held)
    return held is not None


def bind_to_source(path: str, source: str, consumer: str, attempts: int = 5) -> None:
    """Bind the `events` table at `path` to `source` (`<store id>/<consumer>`), or `LakeHoldsAnotherSource` if it
    is bound to another. A table made by this release has the binding in its creation commit; one made by an older
    release gets it now, in a commit of its own that fails if anything commits first (then it is read again), so
    that of two stores binding at once one wins and the other reads the winner's."""
    for _ in range(attempts):
        table = DeltaTable(path)
        held = table.metadata().configuration.get(SOURCE_PROPERTY)
        if held == source:
            return
        if held is not None:
            raise LakeHoldsAnotherSource(path, consumer, None, bound_to=held)
        try:
            table.alter.set_table_properties({SOURCE_PROPERTY: source}, raise_if_not_exists=False,
                                             commit_properties=CommitProperties(max_commit_retries=0))
        except CommitFailedError:
            continue
    raise LakeHoldsAnotherSource(path, consumer, None, bound_to=DeltaTable(path).metadata().configuration.get(
        SOURCE_PROPERTY, "a binding other commits kept taking the place of"))


def require_events(warehouse: Location, name: str) -> str:
    """The path of `events` in `warehouse`; `NoEventsYet` (projection `name` has nothing to be built from) if the
    table is not there."""
    path = table_path(warehouse, "events")
    if not is_delta_table(path):
        raise NoEventsYet(name, path)
    return path


def never_written(path: str) -> bool:
    """Whether the Delta table at `path` has no rows ever added: no commit but its creation (version 0) and
    metadata-only ones (its binding to a source, `bind_to_source`), read from the log's files."""
    names = _log_names(path)
    if any(".checkpoint" in n and n.endswith(".parquet") for n in names):
        return False
    later = sorted(n for n in names if n.endswith(".json") and n[:20].isdigit() and int(n[:20]) > 0)
    if len(later) > 2:
        return False
    fs, root = filesystem(path)
    for name in later:
        with fs.open_input_stream(f"{root}/_delta_log/{name}") as f:
            if b'"add"' in f.read():
                return False
    return True


def holds_rows(path: str) -> bool:
    """Whether the Delta table at `path` exists and has any data file (an empty table just created has none)."""
    if not is_delta_table(path):
        return False
    return bool(DeltaTable(path).file_uris())


def table_version(spark: SparkSession, path: str) -> int:
    """The latest commit version of a Delta table."""
    row = spark.sql(f"DESCRIBE HISTORY delta.`{path}` LIMIT 1").first()
    assert row is not None
    return int(row["version"])


def merge_by_key(
    spark: SparkSession, path: str, updates: Any, key: str | Sequence[str], *, app_id: str, version: int,
    update_set: str = "*",
) -> None:
    """Upsert `updates` on `key`, as Delta transaction (`app_id`, `version`): a replay is skipped.

    `update_set` says how a matched row (t) takes the update (u): `*` replaces it; an additive
    projection passes e.g. `t.events = t.events + u.events`. MERGE has no writer options, only
    session confs, and those stay set after the command: they are set and cleared around it.
    """
    keys = [key] if isinstance(key, str) else list(key)
    on = " AND ".join(f"t.{k} = u.{k}" for k in keys)
    with spark_merge_source(spark, updates, path, app_id, version) as view:
        spark.sql(
            f"MERGE INTO delta.`{path}` t USING {view} u ON {on} "
            f"WHEN MATCHED THEN UPDATE SET {update_set} WHEN NOT MATCHED THEN INSERT *"
        )


@contextlib.contextmanager
def spark_merge_source(spark: SparkSession, source: Any, path: str, app_id: str, version: int) -> Iterator[str]:
    """`source` as a temporary view (its name yielded) for a MERGE into `path` committed as Delta transaction
    (`app_id`, `version`): MERGE has no writer options, only session confs, set and cleared around it."""
    view = f"_es_updates_{abs(hash((path, version))) % 10**9}"
    source.createOrReplaceTempView(view)
    spark.conf.set("spark.databricks.delta.write.txnAppId", app_id)
    spark.conf.set("spark.databricks.delta.write.txnVersion", str(version))
    try:
        yield view
    finally:
        spark.conf.unset("spark.databricks.delta.write.txnAppId")
        spark.conf.unset("spark.databricks.delta.write.txnVersion")
        spark.catalog.dropTempView(view)


def rows_added(spark: SparkSession, path: str, after: int, until: int) -> Any:
    """The rows that the commits `after` < version <= `until` inserted (Delta's change data feed)."""
    return (
        spark.read.format("delta").option("readChangeFeed", "true")
        .option("startingVersion", after + 1).option("endingVersion", until).load(path)
        .where("_change_type = 'insert'")
    )


# Spark's words for a vacuumed file, then delta-rs's (object_store's NotFound, local or S3).
CHANGE_FEED_GONE = ("FILE_NOT_EXIST", "DELTA_CHANGE_DATA_FILE_NOT_FOUND", "FileNotFoundException", "Object at location")


def session_of(spark: SparkSession) -> Any:
    """A Spark session from `spark`: the session itself, or a function that returns one (called now)."""
    return spark() if callable(spark) else spark


def files_bytes(table: DeltaTable, column: str | None = None, lo: int = 0, hi: int = 0) -> int:
    """The bytes of the table's files; with `column`, of those whose statistics say it may hold a value in
    [lo, hi] (a file without statistics counts)."""
    adds = pa.table(table.get_add_actions(flatten=True))
    if not adds.num_rows:
        return 0
    sizes = adds["size_bytes"]
    if column is not None and f"min.{column}" in adds.column_names and f"max.{column}" in adds.column_names:
        low, high = adds[f"min.{column}"], adds[f"max.{column}"]
        overlaps = pc.and_(pc.fill_null(pc.less_equal(low, hi), True), pc.fill_null(pc.greater_equal(high, lo), True))
        sizes = sizes.filter(overlaps)
    return int(pc.sum(sizes).as_py() or 0)


def change_feed_gone(exc: BaseException) -> bool:
    """Whether a failed read of `rows_added` means the files of those commits were vacuumed away."""
    return any(mark in str(exc) for mark in CHANGE_FEED_GONE)


def spark_errors() -> tuple[type[BaseException], ...]:
    """What a failed Spark action raises: PySpark's errors (classic and Connect) and py4j's for the JVM's."""
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException

    return (PySparkException, Py4JJavaError)


def transaction_version(path: str, app_id: str) -> int | None:
    """The last `txnVersion` Delta committed for `app_id` (read from the log by delta-rs)."""
    if not is_delta_table(path):
        return None
    v = DeltaTable(path).transaction_version(app_id)
    return None if v is None else int(v)


def ensure_table_arrow(path: str, schema: Any, *, comment: str = "", properties: dict[str, str] | None = None) -> None:
    """Create an empty Delta table of Arrow `schema` with delta-rs, if none is there (race-safe).

    For writers that need no Spark session: Spark reads and writes the table like one it made.
    """
    if is_delta_table(path):
        add_missing_columns(path, schema)
        return
    try:
        # No retry: a creator that loses the race for version 0 would otherwise be committed as version 1,
        # a second CREATE with a new table id (seen with concurrent first runs on S3), which the offsets'
        # binding to the table (the sink) would then take for another table.
        DeltaTable.create(path, schema, mode="ignore", description=comment or None, configuration=properties,
                          commit_properties=CommitProperties(max_commit_retries=0))
    except Exception:  # noqa: BLE001 - a concurrent creator won; anything else re-raises
        if not is_delta_table(path):
            raise


def add_missing_columns(path: str, schema: pa.Schema) -> list[str]:
    """Add to the table at `path` the (nullable) columns of `schema` it lacks, at its end; their names.

    How a table made by an older release takes a new column (`tenant`, `payload_encoding`): one metadata
    commit, no file rewritten; its earlier rows read the new columns as NULL.
    """
    table = DeltaTable(path)
    new = [f for f in schema if not has_columns(table, [f.name])]
    if new:
        try:
            table.alter.add_columns([Field.from_arrow(f.with_nullable(True)) for f in new])
        except Exception:  # noqa: BLE001 - a concurrent writer added them first; anything else re-raises
            if not has_columns(path, [f.name for f in new]):
                raise
    return [f.name for f in new]


def with_tenant(events: Any) -> Any:
    """`events` with `tenant` never NULL: rows written before tenants existed read '' (no tenant)."""
    from pyspark.sql import functions as F

    return events.withColumn("tenant", F.coalesce(F.col("tenant"), F.lit("")))


def tenant_filled(events: pa.Table) -> pa.Table:
    """The same over Arrow rows."""
    i = events.column_names.index("tenant")
    return events.set_column(i, "tenant", pc.fill_null(events["tenant"].cast(pa.string()), ""))


def latest_per_stream(rows: pa.Table, newest_first: list[tuple[str, str]]) -> pa.Table:
    """The first row of each (tenant, stream_id) of `rows` in the order `newest_first` gives within a stream (e.g.
    `[("version", "descending")]`): each stream's latest row."""
    if rows.num_rows < 2:
        return rows
    s = rows.sort_by([("tenant", "ascending"), ("stream_id", "ascending"), *newest_first])
    ids, tenants = s["stream_id"].combine_chunks(), s["tenant"].combine_chunks()
    n = len(ids)
    changed = pc.or_(pc.not_equal(ids.slice(1), ids.slice(0, n - 1)), pc.not_equal(tenants.slice(1), tenants.slice(0, n - 1)))
    return s.filter(pa.concat_arrays([pa.array([True]), changed]))


def has_columns(table: str | DeltaTable, names: Sequence[str]) -> bool:
    """Whether the Delta table (a path, read from its log, or one loaded already) has every column in `names`."""
    held = set((DeltaTable(table) if isinstance(table, str) else table).schema().to_arrow().names)
    return all(n in held for n in names)


def first_commit_id(path: str) -> str | None:
    """Delta's id of the table from its first commit file, None where that file is gone (log cleanup) or not there:
    what a reader that keeps a table open asks each time, to see that the folder now holds another table (a new
    table has its first commit; one so old its first commit was cleaned up has not been made anew)."""
    fs, root = filesystem(path)
    try:
        with fs.open_input_stream(f"{root}/_delta_log/{0:020d}.json") as log:
            for line in log.read().decode("utf-8").splitlines():
                action = json.loads(line) if line.strip() else {}
                if "metaData" in action:
                    return str(action["metaData"]["id"])
    except (FileNotFoundError, OSError):
        return None
    return None


def table_id(path: str) -> str:
    """Delta's id of the table (`metaData.id`, set at creation): a recreated table at the same path has a new one.

    Read from the first commit, whose size does not grow with the table; only once log cleanup has
    removed that file is the whole log loaded (the id never changes over a table's life).
    """
    found = first_commit_id(path)
    return found if found is not None else str(DeltaTable(path).metadata().id)


# -- events by key, for `offsets rebase` -------------------------------------------------------------

# An event's key in the lake and in the store: a stream id is unique within its tenant only ('' without tenants).
KEY = ["tenant", "stream_id", "version"]
_KEY_SCHEMA = pa.schema([("tenant", pa.string()), ("stream_id", pa.string()), ("version", pa.int32())])


def event_keys(path: str) -> pa.Table:
    """(tenant, stream_id, version, recorded_at as UTC microseconds) of every event in the `events` table at `path`."""
    if not is_delta_table(path):
        return pa.table({**{f.name: pa.array([], f.type) for f in _KEY_SCHEMA}, "recorded_at": pa.array([], pa.int64())})
    dataset = DeltaTable(path).to_pyarrow_dataset()
    keys = dataset.to_table(columns=[c for c in [*KEY, "recorded_at"] if c in dataset.schema.names])
    return pa.table({
        "tenant": keys_tenant(keys),
        "stream_id": keys["stream_id"].cast(pa.string()), "version": keys["version"].cast(pa.int32()),
        "recorded_at": pc.cast(keys["recorded_at"], UTC_MICROS).cast(pa.int64()),
    })


def highest_batch_id(path: str) -> int:
    """The highest `batch_id` the `events` table at `path` holds (0 for none): one column read."""
    if not is_delta_table(path):
        return 0
    top = pc.max(DeltaTable(path).to_pyarrow_dataset().to_table(columns=["batch_id"])["batch_id"]).as_py()
    return int(top or 0)


def keys_tenant(rows: pa.Table) -> pa.Array | pa.ChunkedArray:
    """The `tenant` column of `rows` as the key has it: '' where it is NULL or absent (a lake from before tenants)."""
    if "tenant" not in rows.column_names:
        return pa.repeat(pa.scalar("", pa.string()), rows.num_rows)
    return pc.fill_null(rows["tenant"].cast(pa.string()), "")


def key_label(rows: pa.Table, i: int) -> str:
    """`tenant/stream@version` (or `stream@version` without a tenant) of row `i`: how messages name an event."""
    tenant = str(keys_tenant(rows)[i])
    return f"{tenant + '/' if tenant else ''}{rows['stream_id'][i]}@{rows['version'][i]}"


def anti_join_keys(left: pa.Table, right: pa.Table) -> pa.Table:
    """The rows of `left` with no row of the same (tenant, stream_id, version, recorded_at) in `right`."""
    return left.join(right, keys=[*KEY, "recorded_at"], join_type="left anti")


def without_events_in_lake(batches: Iterable[pa.RecordBatch], path: str) -> Iterator[pa.RecordBatch]:
    """The events of `batches` whose (tenant, stream_id, version) the `events` table at `path` does not hold,
    streamed."""
    if not is_delta_table(path):
        yield from batches
        return
    lake = DeltaTable(path).to_pyarrow_dataset()
    for batch in batches:
        if batch.num_rows == 0:
            continue
        # The slice filter lets the scan skip the files of other slices (min/max statistics on `slice`).
        held = lake.to_table(
            columns=[c for c in KEY if c in lake.schema.names],
            filter=pc.field("slice").isin(pc.unique(batch["slice"]))
            & pc.field("stream_id").isin(pc.unique(batch["stream_id"])),
        )
        if held.num_rows == 0:
            yield batch
            continue
        held = pa.table([keys_tenant(held), held["stream_id"].cast(pa.string()), held["version"].cast(pa.int32())],
                        schema=_KEY_SCHEMA)
        rows = tenant_filled(pa.Table.from_batches([batch]))  # NULL and '' are the same tenant: none
        kept = rows.join(held.cast(rows.select(KEY).schema), keys=KEY, join_type="left anti")
        yield from kept.select(rows.column_names).to_batches()
