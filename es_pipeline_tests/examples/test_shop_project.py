"""The example team project (examples/shop) as its users meet it: a `dg` project whose `defs.yaml` configures
es_pipeline's component with two domains (shop, billing), checked by `dg`, loaded and run through Dagster."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
from deltalake import DeltaTable
from shop.domain import domain as SHOP
from shop.domain import sku_sales

from es_pipeline.dev import emmett_client as emmett
from es_pipeline.domain import Event
from es_pipeline.source import mapping
from es_pipeline.store.adopt import adopt
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.roles import StoreDsn

# `dg` in subprocesses and eight Dagster runs: `make test`'s, not `make check`'s (which stays under 3 minutes).
pytestmark = pytest.mark.slow

PROJECT = Path(__file__).resolve().parents[2] / "examples" / "shop"
DG = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "dg"


def _dg(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(DG), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def _env(dsn: str, warehouse: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ES_PIPELINE_")}
    return {**env, "ES_PIPELINE_PG_DSN": dsn, "ES_PIPELINE_WAREHOUSE": str(warehouse), "ES_PIPELINE_TAIL_SECONDS": "0"}


def _copy(tmp_path: Path, replace: tuple[str, str]) -> Path:
    """The project copied with its root module renamed (the installed `shop` is the original) and its
    defs.yaml edited."""
    copy = tmp_path / "shop"
    shutil.copytree(PROJECT, copy, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (copy / "shop").rename(copy / "shop_copy")
    toml = copy / "pyproject.toml"
    toml.write_text(toml.read_text().replace('"shop"', '"shop_copy"').replace('"shop.definitions"', '"shop_copy.definitions"'))
    yaml = copy / "shop_copy" / "defs" / "lake" / "defs.yaml"
    yaml.write_text(yaml.read_text().replace(*replace))
    return copy


@pytest.mark.slow  # `dg` processes (20 s): make test's tier, not make check's
def test_dg_checks_the_yaml_and_refuses_a_misspelled_attribute_or_a_bad_value_by_name(
    tmp_path: Path, dsn: StoreDsn
) -> None:
    env = _env(dsn.extractor, tmp_path / "lake")
    good = _dg(["check", "yaml"], PROJECT, env)
    assert good.returncode == 0, good.stdout + good.stderr
    misspelled = _dg(["check", "yaml"], _copy(tmp_path / "a", ("slice_ranges: 8", "slice_rangez: 8")), env)
    assert misspelled.returncode != 0 and "'slice_rangez' was unexpected" in misspelled.stdout + misspelled.stderr
    # A value's type is checked when the component loads (YAML values may be templates until then).
    bad = _dg(["check", "defs"], _copy(tmp_path / "b", ("slice_ranges: 8", "slice_ranges: many")), env)
    assert bad.returncode != 0 and "slice_ranges" in bad.stdout + bad.stderr, bad.stdout[-2000:] + bad.stderr[-2000:]


def test_dg_lists_the_definitions_the_component_builds(tmp_path: Path, dsn: StoreDsn) -> None:
    listed = _dg(["list", "defs", "--json"], PROJECT, _env(dsn.extractor, tmp_path / "lake"))
    assert listed.returncode == 0, listed.stdout + listed.stderr
    text = listed.stdout
    for name in ("events", "stream_state", "stream_catalog", "event_type_daily", "snapshots", "new_events_sensor"):
        assert name in text, name
    assert "reducers: account, cart, invoice" in text  # two domains in one location: the shop's and billing's


def test_the_shop_location_folds_both_domains_through_dagster(
    dsn: StoreDsn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warehouse = tmp_path / "lake"
    for key, value in _env(dsn.extractor, warehouse).items():
        if key.startswith("ES_PIPELINE_"):
            monkeypatch.setenv(key, value)
    store = EventStore(dsn)
    store.append("invoice-1", "invoice", [NewEvent("InvoiceIssued", {"amount": 12.5}), NewEvent("InvoicePaid", {})], 0)
    store.append("invoice-2", "invoice", [NewEvent("InvoiceIssued", {"amount": 3})], 0)
    store.append("cart-1", "cart", [NewEvent("ItemAdded", {"sku": "a", "qty": 2, "unit_price": 1.5})], 0)
    store.append("ledger-1", "ledger", [NewEvent("Posted", {"amount": 1})], 0)  # a type no domain folds
    import shop.definitions

    defs = dg.load_from_defs_folder(path_within_project=Path(shop.definitions.__file__).parent)
    events = defs.resolve_assets_def("events")
    state = defs.resolve_assets_def("stream_state")
    instance = dg.DagsterInstance.ephemeral()
    for key in events.partitions_def.get_partition_keys():
        assert dg.materialize([events], partition_key=key, instance=instance).success
    result = dg.materialize([state], instance=instance)
    assert result.success
    metadata = result.asset_materializations_for_node("stream_state")[0].metadata
    assert metadata["streams_without_reducer"].value == 1
    rows = {r["stream_id"]: r for r in DeltaTable(str(warehouse / "stream_state")).to_pyarrow_table().to_pylist()}
    assert json.loads(rows["invoice-1"]["state"]) == {"amount": 12.5, "paid": True}
    assert rows["ledger-1"]["state"] is None and rows["ledger-1"]["version"] == 1
    invoices = {r["stream_id"]: r for r in DeltaTable(str(warehouse / "stream_state_invoice")).to_pyarrow_table().to_pylist()}
    assert {s: (r["amount"], r["paid"]) for s, r in invoices.items()} == {"invoice-1": (12.5, True), "invoice-2": (3.0, False)}
    assert DeltaTable(str(warehouse / "stream_state_cart")).to_pyarrow_table().to_pylist()[0]["total"] == 3.0


def _upcast_by_hand(event_type: str, payload: dict[str, Any]) -> dict[str, Any]:
    """The old carts' `price`, renamed as today's payloads name it: the test's own upcast, not the shop's."""
    if event_type == "ItemAdded" and "price" in payload and "unit_price" not in payload:
        return {**{k: v for k, v in payload.items() if k != "price"}, "unit_price": payload["price"]}
    return payload


def test_the_shop_project_adopts_an_emmett_store_and_every_table_equals_a_fold_of_it(
    dsn: StoreDsn, emmett_app: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spark: Any
) -> None:
    """Emmett's own client writes carts, old payloads (`price`, removals) then today's while more old ones come;
    the shop's code location adopts the store, extracts it and folds it through Dagster: `stream_state`, its typed
    `stream_state_cart` (the shop's reducer, behind its upcaster) and `sku_sales` (its cross-stream projection)
    each equal a fold of `emt_messages` computed here."""
    warehouse = tmp_path / "lake"
    assert emmett.finished(emmett.start_appending(emmett_app, "boot", 1, 3)) == 3  # Emmett creates its tables
    adopt(dsn, mapping.emmett(), echo=lambda _: None)
    old = [emmett.start_appending(emmett_app, f"old{w}", 5, 12, per_append=1 + w, shape="v1") for w in range(2)]
    appended = sum(emmett.finished(w) for w in old)
    writers = [emmett.start_appending(emmett_app, f"new{w}", 5, 10, per_append=2, shape="v2") for w in range(2)]
    writers.append(emmett.start_appending(emmett_app, "late", 4, 12, per_append=3, shape="v1"))
    for key, value in {**_env(dsn.extractor, warehouse), "ES_PIPELINE_SOURCE": "emmett"}.items():
        if key.startswith("ES_PIPELINE_"):
            monkeypatch.setenv(key, value)
    import shop.definitions
    defs = dg.load_from_defs_folder(path_within_project=Path(shop.definitions.__file__).parent)
    events, state, sales, catalog, daily = (defs.resolve_assets_def(k) for k in (
        "events", "stream_state", "sku_sales", "stream_catalog", "event_type_daily"))
    instance = dg.DagsterInstance.ephemeral()
    appended += sum(emmett.finished(w) for w in writers)  # extraction while Emmett writes: test_emmett.py, e2e/
    assert appended == 2 * 5 * 12 + 2 * 5 * 10 + 4 * 12
    for key in events.partitions_def.get_partition_keys():
        assert dg.materialize([events], partition_key=key, instance=instance).success
    assert dg.materialize([state], instance=instance).success
    result = dg.materialize([sales], instance=instance)
    assert result.success
    assert result.asset_materializations_for_node("sku_sales")[0].metadata["events_waiting"].value == 0

    assert_shop_tables_equal_emmett(dsn, warehouse, appended + 3)
    # The projections that need no domain, against the store's own counts.
    assert dg.materialize([catalog, daily], instance=instance).success  # Spark: the session the suite holds
    with psycopg.connect(dsn) as conn:
        per_stream = {(t, s): (n, v) for t, s, n, v in conn.execute(
            "SELECT partition, stream_id, count(*), max(stream_position) FROM emt_messages WHERE message_kind = 'E' "
            "GROUP BY 1, 2").fetchall()}
        per_type = {(t, e): n for t, e, n in conn.execute(
            "SELECT partition, message_type, count(*) FROM emt_messages WHERE message_kind = 'E' GROUP BY 1, 2").fetchall()}
    listed = DeltaTable(str(warehouse / "stream_catalog")).to_pyarrow_table().to_pylist()
    assert {(r["tenant"], r["stream_id"]): (r["events"], r["version"]) for r in listed} == per_stream
    counted: dict[tuple[str, str], int] = {}
    for r in DeltaTable(str(warehouse / "event_type_daily")).to_pyarrow_table().to_pylist():
        counted[(r["tenant"], r["event_type"])] = counted.get((r["tenant"], r["event_type"]), 0) + r["events"]
    assert counted == per_type


def assert_shop_tables_equal_emmett(dsn: str, warehouse: Path, expected_events: int | None = None) -> None:
    """`stream_state_cart` and `sku_sales` equal folds of `emt_messages` computed here: the carts by the shop's
    reducer over each stream's events (upcast by hand), `sku_sales` by its fold over every item event in the lake's
    order (each event's batch read from `events`)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT partition, stream_id, stream_position, global_position, message_type, message_data FROM emt_messages "
            "WHERE message_kind = 'E' ORDER BY partition, stream_id, stream_position").fetchall()
    if expected_events is not None:
        assert len(rows) == expected_events
    carts: dict[tuple[str, str], dict[str, Any]] = {}
    for tenant, sid, _, _, event_type, payload in rows:
        carts[(tenant, sid)] = SHOP.reducers["cart"].fold(carts.get((tenant, sid), {}), Event(
            sid, 0, event_type, _upcast_by_hand(event_type, payload)))
    states = {(r["tenant"], r["stream_id"]): json.loads(r["state"])
              for r in DeltaTable(str(warehouse / "stream_state")).to_pyarrow_table().to_pylist()}
    assert states == carts
    typed = {(r["tenant"], r["stream_id"]): r
             for r in DeltaTable(str(warehouse / "stream_state_cart")).to_pyarrow_table().to_pylist()}
    assert set(typed) == set(carts)
    for k, cart in carts.items():
        row = typed[k]
        assert (row["total"], row["status"], dict(row["prices"])) == (cart["total"], cart["status"], cart["prices"]), k
    assert any(dict(r["prices"]) and r["total"] != 1.5 * sum(dict(r["items"]).values()) for r in typed.values()), \
        "no old payload's price reached a cart"
    batch = {(r["tenant"], r["stream_id"], r["version"]): r["batch_id"] for r in DeltaTable(str(warehouse / "events"))
             .to_pyarrow_table(columns=["tenant", "stream_id", "version", "batch_id"]).to_pylist()}
    items = sorted((t, p["sku"], batch[(t, s, v)], gp, s, v, e, _upcast_by_hand(e, p)) for t, s, v, gp, e, p in rows
                   if e in ("ItemAdded", "ItemRemoved"))
    expected: dict[tuple[str, str], Any] = {}
    for tenant, sku, _, _, sid, version, event_type, payload in items:
        expected[(tenant, sku)] = sku_sales(expected.get((tenant, sku), {}), Event(sid, version, event_type, payload))
    held = {(r["tenant"], r["sku"]): r for r in DeltaTable(str(warehouse / "sku_sales")).to_pyarrow_table().to_pylist()}
    assert {k: json.loads(r["state"]) for k, r in held.items()} == expected
    assert sum(r["events"] for r in held.values()) == len(items)
    assert sum(r["removals"] for r in held.values()) > 0 and all(r["last_price"] for r in held.values())
