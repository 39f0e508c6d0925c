"""Streaming Arrow appends into a real Delta table (delta-rs): one commit whatever the size, the txn id that makes a
replay a no-op, statistics for the named columns only, and Spark-written folders committed the same way."""

from __future__ import annotations

import secrets
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from es_pipeline.lake.delta import arrow_append, tables
from es_pipeline.lake.delta.arrow_append import append_batches, commit_parquet_folder, new_folder

SCHEMA = pa.schema([("id", pa.int64()), ("slice", pa.int32()), ("payload", pa.string())])


def _table(tmp_path: Path) -> str:
    path = str(tmp_path / "t")
    tables.ensure_table_arrow(path, SCHEMA, properties={"delta.dataSkippingStatsColumns": "id,slice"})
    return path


def _batch(lo: int, n: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"id": list(range(lo, lo + n)), "slice": [i % 7 for i in range(n)],
                                       "payload": [secrets.token_hex(100) for _ in range(n)]}, schema=SCHEMA)


def test_many_batches_are_one_commit_in_several_files_and_a_replay_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(arrow_append, "ROW_GROUP_BYTES", 20_000)
    monkeypatch.setattr(arrow_append, "TARGET_FILE_BYTES", 60_000)
    path = _table(tmp_path)
    written = append_batches((_batch(i * 500, 500) for i in range(10)), SCHEMA, path, app_id="w", version=3)
    table = DeltaTable(path)
    assert written == 5_000 and table.version() == 1 and table.transaction_version("w") == 3
    assert len(table.file_uris()) > 1  # a new file every TARGET_FILE_BYTES: memory holds one row group
    assert sorted(table.to_pyarrow_table()["id"].to_pylist()) == list(range(5_000))
    adds = pa.table(table.get_add_actions(flatten=True))
    assert "min.id" in adds.column_names and "min.payload" not in adds.column_names  # the named columns only
    assert append_batches([_batch(0, 10)], SCHEMA, path, app_id="w", version=3) is None  # a replay
    assert append_batches([_batch(0, 10)], SCHEMA, path, app_id="w", version=2) is None
    assert append_batches([], SCHEMA, path, app_id="w", version=4) == 0  # no rows, no commit
    assert DeltaTable(path).version() == 1


def test_a_refused_commit_leaves_the_table_as_it_was(tmp_path: Path) -> None:
    path = _table(tmp_path)

    def refuse() -> None:
        raise RuntimeError("the lock was lost")

    with pytest.raises(RuntimeError, match="the lock was lost"):
        append_batches([_batch(0, 100)], SCHEMA, path, app_id="w", version=1, before_commit=refuse)
    table = DeltaTable(path)
    assert table.version() == 0 and table.to_pyarrow_table().num_rows == 0 and table.transaction_version("w") is None


def test_a_folder_of_parquet_files_is_committed_once_and_a_wrong_one_is_refused(tmp_path: Path) -> None:
    path = _table(tmp_path)
    folder = new_folder("spark")
    (Path(path) / folder).mkdir()
    for i in range(3):
        pq.write_table(pa.Table.from_batches([_batch(i * 100, 100)]), Path(path) / folder / f"part-{i}.parquet")
    assert commit_parquet_folder(path, SCHEMA, folder, app_id="s", version=1, expect_rows=300) == 300
    assert commit_parquet_folder(path, SCHEMA, folder, app_id="s", version=1) is None  # a replay
    assert DeltaTable(path).to_pyarrow_table().num_rows == 300
    wrong = new_folder("spark")
    (Path(path) / wrong).mkdir()
    pq.write_table(pa.table({"id": [1], "other": ["y"]}), Path(path) / wrong / "part-0.parquet")
    with pytest.raises(ValueError, match="does not have the table's columns and types"):
        commit_parquet_folder(path, SCHEMA, wrong, app_id="s", version=2)
    short = new_folder("spark")
    (Path(path) / short).mkdir()
    pq.write_table(pa.Table.from_batches([_batch(0, 5)]), Path(path) / short / "part-0.parquet")
    with pytest.raises(ValueError):
        commit_parquet_folder(path, SCHEMA, short, app_id="s", version=2, expect_rows=6)
    assert DeltaTable(path).version() == 1 and DeltaTable(path).transaction_version("s") == 1
