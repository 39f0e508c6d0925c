"""`events` in bounded pieces (lake/delta/pieces.py): every row in exactly one piece, the piece of its key."""

from __future__ import annotations

import os
import random

import pyarrow as pa
import pytest

from es_pipeline.lake.delta import pieces


def _rows(n: int, seed: int = 7) -> pa.Table:
    rnd = random.Random(seed)
    return pa.table({"slice": pa.array([rnd.randrange(1024) for _ in range(n)], pa.int32()),
                     "position": pa.array(range(n), pa.int64())})


def test_count_for_cuts_by_bytes_and_never_below_a_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pieces, "PIECE_BYTES", 100)
    assert [pieces.count_for(b) for b in (0, 1, 100, 101, 250)] == [1, 1, 1, 2, 3]
    assert pieces.count_for(10**9) == pieces.MAX_PIECES, "as many files open at once at most"


def test_every_row_lands_once_in_the_piece_of_its_slice_and_the_folder_goes() -> None:
    rows = _rows(10_000)
    with pieces.spread(rows.to_batches(max_chunksize=777), rows.schema, 7, pieces.by_slice(7)) as parts:
        got = [parts.read(i) for i in range(parts.count)]
        folder = parts._folder  # noqa: SLF001 - the spill folder, gone on leaving
        assert folder is not None and os.path.isdir(folder)
    assert not os.path.exists(folder)
    assert sorted(pa.concat_tables(got)["position"].to_pylist()) == list(range(10_000))
    for i, piece in enumerate(got):
        assert piece.num_rows and all(s * 7 // 1024 == i for s in piece["slice"].to_pylist()), i


def test_one_piece_is_the_rows_read_whole_and_chunks_gather_batches() -> None:
    rows = _rows(1_000)
    with pieces.spread(rows.to_batches(max_chunksize=64), rows.schema, 1, pieces.by_slice(1)) as parts:
        assert parts.count == 1 and parts.read(0).equals(rows.combine_chunks())
    sizes = [t.num_rows for t in pieces.chunks(rows.to_batches(max_chunksize=64), 300)]
    assert sizes == [320, 320, 320, 40]
