"""The example team project (examples/shop) as its users meet it: a `dg` project whose `defs.yaml` configures
es_pipeline's component with two domains (shop, billing), checked by `dg`, loaded and run through Dagster."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import dagster as dg
import pytest
from deltalake import DeltaTable

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
