"""Spark writes Delta through the cached jars; an independent reader (delta-rs) reads it back."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.arrow_append import commit_parquet_folder, new_folder


def test_spark_written_delta_table_reads_back_through_deltalake(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "t")
    df = spark.createDataFrame([(i, f"v{i}") for i in range(100)], "id BIGINT, v STRING")
    df.write.format("delta").save(path)
    spark.createDataFrame([(100, "v100")], "id BIGINT, v STRING").write.format("delta").mode("append").save(path)
    table = DeltaTable(path).to_pyarrow_table()
    assert table.num_rows == 101
    assert sorted(table.column("id").to_pylist()) == list(range(101))
    assert DeltaTable(path).version() == 1


SCHEMA = pa.schema([("id", pa.int64()), ("at", pa.timestamp("us", tz="UTC")), ("v", pa.string())])


def _spark_files(spark: Any, root: str, rows: int, *, timestamps: str = "TIMESTAMP_MICROS") -> str:
    folder = new_folder("spark-batch-1")
    spark.conf.set("spark.sql.parquet.outputTimestampType", timestamps)
    try:
        spark.range(rows).selectExpr("id", "timestamp_micros(1700000000000000 + id) AS at", "CAST(id AS STRING) AS v") \
            .write.parquet(f"{root}/{folder}")
    finally:
        spark.conf.set("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
    return folder


def test_parquet_files_spark_wrote_are_committed_by_delta_rs_with_their_statistics(spark: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    tables.ensure_table_arrow(path, SCHEMA)
    folder = _spark_files(spark, path, 1000)
    assert commit_parquet_folder(path, SCHEMA, folder, app_id="a", version=1, expect_rows=1000) == 1000
    assert commit_parquet_folder(path, SCHEMA, folder, app_id="a", version=1, expect_rows=1000) is None, "a replay"
    table = DeltaTable(path)
    assert (table.version(), table.transaction_version("a")) == (1, 1)
    assert sorted(table.to_pyarrow_table()["id"].to_pylist()) == list(range(1000))
    assert spark.read.format("delta").load(path).count() == 1000
    stats = pa.table(table.get_add_actions(flatten=False)).to_pylist()
    assert sum(s["num_records"] for s in stats) == 1000
    assert min(s["min"]["id"] for s in stats) == 0 and max(s["max"]["id"] for s in stats) == 999
    assert min(s["min"]["at"] for s in stats) == dt.datetime(2023, 11, 14, 22, 13, 20, tzinfo=dt.UTC)


def test_spark_files_that_are_not_the_batch_are_refused_before_any_commit(spark: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    tables.ensure_table_arrow(path, SCHEMA)
    short = _spark_files(spark, path, 10)
    with pytest.raises(ValueError, match="10 rows .* 11 were counted: not committed"):
        commit_parquet_folder(path, SCHEMA, short, app_id="a", version=1, expect_rows=11)
    int96 = _spark_files(spark, path, 10, timestamps="INT96")
    with pytest.raises(ValueError, match="does not have the table's columns and types"):
        commit_parquet_folder(path, SCHEMA, int96, app_id="a", version=1, expect_rows=10)
    assert DeltaTable(path).version() == 0
