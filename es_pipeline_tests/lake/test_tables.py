"""Spark writes Delta through the cached jars; an independent reader (delta-rs) reads it back."""

from __future__ import annotations

from pathlib import Path

from deltalake import DeltaTable


def test_spark_written_delta_table_reads_back_through_deltalake(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "t")
    df = spark.createDataFrame([(i, f"v{i}") for i in range(100)], "id BIGINT, v STRING")
    df.write.format("delta").save(path)
    spark.createDataFrame([(100, "v100")], "id BIGINT, v STRING").write.format("delta").mode("append").save(path)
    table = DeltaTable(path).to_pyarrow_table()
    assert table.num_rows == 101
    assert sorted(table.column("id").to_pylist()) == list(range(101))
    assert DeltaTable(path).version() == 1
