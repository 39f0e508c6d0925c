"""The shop's domain on an Emmett store, kept by a real Dagster daemon: the sensor extracts, declarative automation
folds `stream_state` (its typed tables) and the cross-stream `sku_sales`, while Emmett's own client appends."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from es_pipeline.dev import emmett_client as emmett
from es_pipeline.dev.stack import dagster_stack
from es_pipeline.source import mapping
from es_pipeline.store.adopt import adopt
from es_pipeline_tests.examples.test_shop_project import assert_shop_tables_equal_emmett
from es_pipeline_tests.support.roles import StoreDsn


def _equal(dsn: str, warehouse: Path) -> bool:
    try:
        assert_shop_tables_equal_emmett(dsn, warehouse)
    except (AssertionError, FileNotFoundError, OSError, KeyError):  # not there yet, or behind: asked again
        return False
    except Exception as exc:  # noqa: BLE001 - a table being created: asked again; the wait's end names it
        if "No such file" in str(exc) or "not a Delta table" in str(exc).lower() or "TableNotFound" in str(exc):
            return False
        raise
    return True


@pytest.mark.timeout(900)
def test_the_daemon_keeps_the_shops_tables_equal_to_an_emmett_store_its_client_writes(
    pg_server: str, dsn: StoreDsn, emmett_app: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert emmett.finished(emmett.start_appending(emmett_app, "boot", 1, 3)) == 3  # Emmett creates its tables
    adopt(dsn, mapping.emmett(), echo=lambda _: None)
    env = {"ES_PIPELINE_DOMAIN": "shop.domain", "ES_PIPELINE_SOURCE": "emmett"}
    with dagster_stack(admin_dsn=pg_server, dsn=dsn.extractor, tmp=tmp_path, slice_ranges=2, sensor_interval=1,
                       connect=False, automation=True, extra_env=env) as stack:
        for key in ("DAGSTER_HOME", "DAGSTER_PG_URL"):
            monkeypatch.setenv(key, stack.env[key])
        writers = [emmett.start_appending(emmett_app, "old", 4, 12, per_append=2, shape="v1"),
                   emmett.start_appending(emmett_app, "new", 4, 10, per_append=3, shape="v2")]
        appended = sum(emmett.finished(w) for w in writers)
        assert appended == 4 * 12 + 4 * 10
        deadline = time.monotonic() + 420
        while not _equal(dsn, stack.warehouse):
            if time.monotonic() > deadline:
                assert_shop_tables_equal_emmett(dsn, stack.warehouse)  # names what differs
            time.sleep(2)
        instance = dg.DagsterInstance.get()
        kept: dict[str, Any] = {}
        for name in ("stream_state", "sku_sales"):
            event = instance.get_latest_materialization_event(dg.AssetKey(name))
            assert event is not None, f"{name} was never materialized"
            kept[name] = event.run_id
        assert kept["stream_state"] and kept["sku_sales"]
