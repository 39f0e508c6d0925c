"""Declared folds on a real store (es_pipeline/declared.py, lake/state/declared_build.py): the shop's accounts
declared (examples/shop, `shop.summary`), written by concurrent writers with rollbacks and out-of-order commits, folded
by every path: the first build in process (DuckDB's aggregation), increments, a revision rebuilt beside, the first
build on Spark from nothing (Spark's aggregation). Each time the lake's account states equal a fold of the store by the equivalent Python reducer
written here, with exact decimals; the typed table holds the balance as a decimal column."""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable
from shop.summary import summary as SUMMARY

from es_pipeline.dev.workload import run_workload
from es_pipeline.domain import Domain
from es_pipeline.lake.delta import tables
from es_pipeline.lake.follow import follow
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state import declared_build, declared_spark, rebuild
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.store.event_store import EventStore
from es_pipeline_tests.support.hooks import no_spark
from es_pipeline_tests.support.lakecheck import extract_all
from es_pipeline_tests.support.roles import StoreDsn

HERE = Engine(spark=no_spark)
CENT = Decimal("0.01")


def by_hand(state: dict[str, Any], event_type: str, payload: dict[str, Any]) -> dict[str, Any]:
    """The summary as a team would write it in Python."""
    s = {"balance": Decimal("0.00"), "deposits": 0, "withdrawals": 0, **state}
    if event_type == "Opened":
        if s.get("owner") is None and payload.get("owner") is not None:
            s["owner"] = payload["owner"]
        if payload.get("currency") is not None:
            s["currency"] = payload["currency"]
        s["status"] = "open"
    elif event_type == "Closed":
        s["status"] = "closed"
    elif event_type in ("Deposited", "Withdrawn"):
        amount = Decimal(str(payload["amount"])).quantize(CENT)
        s["balance"] = (s["balance"] + (amount if event_type == "Deposited" else -amount)).quantize(CENT)
        s["deposits" if event_type == "Deposited" else "withdrawals"] += 1
    return s


def store_accounts(dsn: str) -> dict[str, tuple[int, dict[str, Any]]]:
    out: dict[str, tuple[int, dict[str, Any]]] = {}
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT stream_id, version, event_type, payload FROM es.events "
                            "WHERE stream_type = 'account' ORDER BY stream_id, version").fetchall()
    for stream_id, version, event_type, payload in rows:
        out[stream_id] = (version, by_hand(out.get(stream_id, (0, {}))[1], event_type, payload))
    return out


def lake_accounts(warehouse: Path) -> dict[str, tuple[int, dict[str, Any]]]:
    rows = DeltaTable(str(warehouse / "stream_state")).to_pyarrow_table().to_pylist()
    out = {}
    for r in rows:
        if r["stream_type"] == "account":
            state = json.loads(r["state"])
            state["balance"] = Decimal(state["balance"])
            out[r["stream_id"]] = (r["version"], state)
    return out


def typed_balances(warehouse: Path) -> dict[str, Decimal]:
    rows = DeltaTable(str(warehouse / "stream_state_account")).to_pyarrow_table(columns=["stream_id", "balance"])
    return dict(zip(rows["stream_id"].to_pylist(), rows["balance"].to_pylist(), strict=True))


def revised(domain: Domain, revision: int) -> Domain:
    """`domain` with the accounts' declaration at `revision` (the same fields: a rebuild, states unchanged)."""
    out = copy.copy(domain)
    held = domain.reducers["account"]
    out.reducers = {**domain.reducers, "account": dataclasses.replace(held, revision=revision)}
    out._folds = None
    return out


@pytest.fixture
def natively(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The streams each first build made by DuckDB's aggregation (the real build, watched)."""
    made: list[int] = []
    real = declared_build.build

    def watched(dataset: Any, declared: Any) -> declared_build.Native:
        native = real(dataset, declared)
        made.append(native.out.num_rows)
        return native

    monkeypatch.setattr(declared_build, "build", watched)
    return made


def test_declared_accounts_under_concurrent_writers_equal_the_stores_fold_on_every_path(
    dsn: StoreDsn, spark: Any, warehouse: Path, natively: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = EventStore(dsn.writer)
    run_workload(store, streams=60, events=900, writers=4, rollback_rate=0.15, max_commit_delay=0.02, seed=65)
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(HERE, warehouse, domain=SUMMARY, store_dsn=dsn.extractor)
    expected = store_accounts(dsn)
    assert len(expected) > 10 and natively and natively[0] == len(expected)  # every account by the aggregation
    assert lake_accounts(warehouse) == expected
    assert typed_balances(warehouse) == {k: s["balance"] for k, (_, s) in expected.items()}

    # Increments while writers append (rollbacks, commits held open): the Python fold of the same declaration.
    errors: list[BaseException] = []

    def writers() -> None:
        try:
            run_workload(EventStore(dsn.writer), streams=60, events=600, writers=4, rollback_rate=0.15,
                         max_commit_delay=0.05, seed=66, rate=150.0)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    writing = threading.Thread(target=writers)
    writing.start()
    while writing.is_alive():
        extract_all(dsn.extractor, None, warehouse)
        update_stream_state(HERE, warehouse, domain=SUMMARY, store_dsn=dsn.extractor)
    writing.join()
    assert not errors
    extract_all(dsn.extractor, None, warehouse)
    update_stream_state(HERE, warehouse, domain=SUMMARY, store_dsn=dsn.extractor)
    expected = store_accounts(dsn)
    assert lake_accounts(warehouse) == expected
    assert typed_balances(warehouse) == {k: s["balance"] for k, (_, s) in expected.items()}

    # A new revision of the declaration: rebuilt beside (pieces by the Python fold) and swapped in, states the same.
    two = revised(SUMMARY, 2)
    follow(warehouse, dsn.extractor, two)  # a tailing run's pass: the accounts wait for their rebuild
    assert rebuild.run_pending(HERE, warehouse, two, dsn.extractor) == ["account"]
    rows = DeltaTable(str(warehouse / "stream_state")).to_pyarrow_table().to_pylist()
    assert {r["revision"] for r in rows if r["stream_type"] == "account"} == {2}
    assert lake_accounts(warehouse) == expected

    # The lake's state rebuilt from nothing on Spark: every account by Spark's aggregation (lake/state/declared_spark.py),
    # the carts by the Python workers, to the same states.
    for name in ("stream_state", "stream_state_account", "stream_state_cart", "stream_state_cart_history"):
        tables.remove_folder(str(warehouse / name))
    on_spark: list[declared_spark.Native] = []
    real = declared_spark.build
    monkeypatch.setattr(declared_spark, "build", lambda events, declared: on_spark.append(real(events, declared))
                        or on_spark[-1])
    update_stream_state(Engine("spark", spark), warehouse, domain=SUMMARY, store_dsn=dsn.extractor)
    assert len(on_spark) == 1 and on_spark[0].out.count() == len(expected) and on_spark[0].left.count() == 0
    assert lake_accounts(warehouse) == expected
    assert typed_balances(warehouse) == {k: s["balance"] for k, (_, s) in expected.items()}
