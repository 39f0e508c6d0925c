"""The order a cross-stream projection folds in, through a move of the store (docs/domain.md, "The order of events"):
what was extracted from the old cluster, then what the old cluster committed after (restored, extracted late), then
what the new cluster committed, whatever transaction ids the two clusters gave.

The expected state is a fold of the **store**'s events in that order, computed here from the store alone: the
positions extracted before the move are read from the store before it, and the rest sort by position (the
writes below are one at a time, so position is their commit order)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP

from es_pipeline.cli import main
from es_pipeline.domain import Event
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.offsets import batch_frontier
from es_pipeline.extraction.slices import split
from es_pipeline.lake import cross_stream
from es_pipeline.lake.kernel.result import Result
from es_pipeline.source import mapping
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.cluster import another_cluster, dump, restore
from es_pipeline_tests.support.lakecheck import assert_exactly_once_by_key, extract_all
from es_pipeline_tests.support.projections import (
    assert_every_projection_equals_the_store,
    update_every_projection,
)
from es_pipeline_tests.support.roles import StoreDsn, login_roles
from es_pipeline_tests.support.store import burn_transaction_ids

CONSUMER = mapping.load(None, "es").consumer


def _add(dsn: str, cart: str, price: float, qty: int = 1) -> None:
    """Cart `cart` adds one sku X at `price`: a stream of its own (so carts fall in different slices)."""
    store = EventStore(dsn)
    store.append(cart, "cart", [NewEvent("ItemAdded", {"sku": "X", "qty": qty, "unit_price": price})], 0)


def _update(warehouse: Path, extractor_dsn: str) -> Result:
    return cross_stream.update(
        warehouse,
        SHOP,
        "sku_sales",
        store_dsn=extractor_dsn,
        frontier=lambda: batch_frontier(extractor_dsn, CONSUMER),
    )


def _lake(warehouse: Path) -> dict[str, tuple[int, int, float | None, str | None]]:
    return {
        r["sku"]: (r["events"], r["units_added"], r["last_price"], r["last_cart"])
        for r in DeltaTable(str(warehouse / "sku_sales")).to_pyarrow_table().to_pylist()
    }


def _expected(dsn: str, extracted_up_to: int) -> dict[str, tuple[int, int, float | None, str | None]]:
    """`sku_sales` folded from the store: positions up to `extracted_up_to` (in the lake before the move) first,
    then every later one by position."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT stream_id, version, event_type, payload, global_position FROM es.events "
            "WHERE event_type IN ('ItemAdded', 'ItemRemoved') "
            "ORDER BY global_position > %s, global_position",
            (extracted_up_to,),
        ).fetchall()
    fold = SHOP.projections["sku_sales"].fold
    states: dict[str, tuple[int, dict[str, Any]]] = {}
    for stream_id, version, event_type, payload, _ in rows:
        n, state = states.get(payload["sku"], (0, {}))
        states[payload["sku"]] = (n + 1, fold(state, Event(stream_id, version, event_type, payload)))
    return {k: (n, s["units_added"], s["last_price"], s["last_cart"]) for k, (n, s) in states.items()}


def _top_position(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT max(global_position) FROM es.events").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.slow  # a cluster of its own: once, on the suite's PostgreSQL (pg_versions skips it)
def test_the_restored_tail_folds_after_what_was_extracted_and_before_what_the_new_cluster_committed(
    dsn: StoreDsn,
    spark: Any,
    warehouse: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ES_PIPELINE_WAREHOUSE", str(warehouse))
    _add(dsn.writer, "c1", 1.0)
    extract_all(dsn.extractor, None, warehouse)
    assert _update(warehouse, dsn.extractor).events_folded == 1
    assert _lake(warehouse) == {"X": (1, 1, 1.0, "c1")}
    extracted = _top_position(dsn)
    # the old cluster's ids run ahead of the new one's: the restored tail lies above its horizon
    burn_transaction_ids(dsn, 3000)
    for i, cart in enumerate(("c2", "c3", "c4", "c5")):  # committed on the old cluster, not extracted
        _add(dsn.writer, cart, 2.0 + i / 10)

    with ExitStack() as stack:
        admin = stack.enter_context(another_cluster("order"))
        new = StoreDsn.of(
            restore(dump(dsn, tmp_path / "old.dump"), admin, "es_moved"),
            stack.enter_context(login_roles(admin)),
        )
        _add(new.writer, "n1", 3.0)  # the new cluster's own, before the rebase: ids below the restored tail's
        monkeypatch.setenv("ES_PIPELINE_PG_DSN", new.extractor)
        assert main(["offsets", "rebase"]) == 0
        _add(new.writer, "n2", 3.1)  # after the rebase, before the first runs
        with psycopg.connect(new) as conn:
            below = conn.execute(
                "SELECT count(*) FROM es.events WHERE stream_id IN ('n1', 'n2') AND tx_id < "
                "(SELECT min(tx_id) FROM es.events WHERE stream_id = 'c2')"
            ).fetchone()
        assert below is not None and below[0] == 2, (
            "the drill needs the new cluster's ids below the restored tail's"
        )

        # Some slices' first runs: the projection waits for the others (their rows may sort before these).
        ranges = split(4)
        extractor = Extractor(new.extractor, None, warehouse)
        extractor.run(ranges[0])
        waiting = _update(warehouse, new.extractor)
        assert waiting.events_folded == 0
        assert _lake(warehouse) == {"X": (1, 1, 1.0, "c1")}

        for r in ranges[1:]:
            extractor.run(r)
        _update(warehouse, new.extractor)
        assert assert_exactly_once_by_key(warehouse, new) == 7
        assert _lake(warehouse) == _expected(new, extracted)
        assert _lake(warehouse)["X"][2:] == (3.1, "n2")

        _add(new.writer, "n3", 4.0)  # after the move: after everything
        extract_all(new.extractor, None, warehouse)
        _update(warehouse, new.extractor)
        assert _lake(warehouse) == _expected(new, extracted) == {"X": (8, 8, 4.0, "n3")}
        update_every_projection(spark, warehouse, new)  # and every other projection equals the store too
        assert assert_every_projection_equals_the_store(warehouse, new) == 8

        # A whole build folds in the same order as the increments did.
        assert main(["lake", "rebuild", "sku_sales"]) == 0
        _update(warehouse, new.extractor)
        assert _lake(warehouse) == _expected(new, extracted)
