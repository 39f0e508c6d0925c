"""The projection kernel's pure parts (lake/kernel/): positions and their encodings, the engine rule, the one
`Result`. Pure: no database, no Spark, a Delta table only where a position is read from one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from es_pipeline.lake.kernel.engine import SPARK_BYTES, on_spark
from es_pipeline.lake.kernel.position import (
    REVISION_SLOTS,
    Position,
    commit_properties,
    next_txn_version,
    txn_version,
    txn_version_after,
)
from es_pipeline.lake.kernel.result import Result


@dataclass(frozen=True)
class _Reducer:
    revision: int


def test_a_revision_bump_moves_the_position_and_a_replay_does_not() -> None:
    one = {"cart": _Reducer(1)}
    assert txn_version(7, one) == 7 * REVISION_SLOTS + 1
    assert txn_version(7, {"cart": _Reducer(2)}) > txn_version(7, one), "a bump commits with no new event"
    assert txn_version(7, one) == txn_version(7, dict(one)), "the same work, the same version: Delta skips it"
    assert txn_version(8, {}) > txn_version(7, {"cart": _Reducer(REVISION_SLOTS * 5)}), "events first, then revisions"


def test_a_reducer_removed_still_commits_above_what_was_read() -> None:
    read = txn_version(7, {"cart": _Reducer(3), "order": _Reducer(2)})
    after = next_txn_version(7, {"cart": _Reducer(3)}, read)
    assert after == read + 1 and after // REVISION_SLOTS == 7
    assert next_txn_version(8, {"cart": _Reducer(3)}, read) == txn_version(8, {"cart": _Reducer(3)})
    assert txn_version_after(read, 9) == 9 * REVISION_SLOTS + read % REVISION_SLOTS


def test_a_position_reads_what_the_commit_recorded(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    assert Position.of(path, "app").read is None, "no table: no position"
    write_deltalake(path, pa.table({"n": [1]}), commit_properties=commit_properties("app", 41))
    plain = Position.of(DeltaTable(path), "app")
    assert (plain.read, plain.events_version) == (41, 41)
    assert plain.behind(42) and not plain.behind(41)
    assert Position.of(path, "other").behind(0), "another app id (another `events`): nothing folded"
    slotted = Position("app", 41 * REVISION_SLOTS + 5, REVISION_SLOTS)
    assert slotted.events_version == 41 and not slotted.behind(41)
    table = DeltaTable(path)
    table.create_write_transaction([], mode="append", schema=table.schema(), commit_properties=plain.commit(43))
    assert Position.of(path, "app").read == 43, "an empty commit moves the position alone"


@pytest.mark.parametrize(("choice", "size", "spark"), [("spark", 0, True), ("local", SPARK_BYTES * 9, False),
                                                        ("auto", SPARK_BYTES, False), ("auto", SPARK_BYTES + 1, True)])
def test_the_engine_rule(choice: str, size: int, spark: bool) -> None:
    asked: list[int] = []
    assert on_spark(choice, lambda: asked.append(size) or size) is spark
    assert bool(asked) == (choice == "auto"), "the size is read only where it decides"


def test_a_result_short_of_events_is_not_caught_up_and_says_why() -> None:
    done = Result("stream_catalog", 9, 4, 120, rows=30, figures={"keys_updated": 12})
    assert done.worked and done.caught_up and not done.full_rebuild
    assert done.metadata() == {"dagster/row_count": 30, "events_folded": 120, "keys_updated": 12, "events_version": 9,
                               "full_rebuild": False, "engine": "local"}
    short = Result("sku_sales", 9, -1, 5, engine="spark", short="events wait for the batch frontier")
    assert not short.caught_up and short.full_rebuild
    assert short.metadata()["short_of_events"] == "events wait for the batch frontier"
    assert not Result("x", 9, 9, 0).worked


def test_a_results_figures_per_table_and_listed_read_back_as_written() -> None:
    state = Result("stream_state", 9, 4, 7, figures={"history_rows/cart_history": 3, "history_rows/account_history": 2,
                                                      "rebuilding_types": "cart, invoice", "rebuilt_types": "-"})
    assert state.per("history_rows") == {"cart_history": 3, "account_history": 2} and state.per("typed_rows") == {}
    assert state.listed("rebuilding_types") == ("cart", "invoice") and state.listed("rebuilt_types") == ()
    swapped = state.with_figures(rebuilt_types="cart", rebuilding_types="invoice")
    assert swapped.listed("rebuilt_types") == ("cart",) and swapped.listed("rebuilding_types") == ("invoice",)
    assert state.listed("rebuilt_types") == (), "the result it came from is left as it was"


def test_a_cross_stream_position_keeps_its_three_ids_and_moves_as_one() -> None:
    at = Position("es_pipeline.sku.abc@e1", 7, cursor=5, frontier=12)
    assert at.ids == ("es_pipeline.sku.abc@e1", "es_pipeline.sku.abc@e1.cursor", "es_pipeline.sku.abc@e1.frontier")
    assert at.folded == 5 and at.behind(6) and not at.behind(5)
    moved = at.moved(9, cursor=9, frontier=14)
    assert [(t.app_id, t.version) for t in moved.commit().app_transactions] == list(zip(at.ids, (9, 9, 14), strict=True))
    assert not moved.behind(9)
