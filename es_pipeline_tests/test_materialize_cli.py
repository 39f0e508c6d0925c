"""`es-pipeline materialize` as a team runs it after the quickstart: it brings every table up to date, a stream type
waiting for its rebuild included, and never says "up to date" while one waits; `status` says so too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deltalake import DeltaTable

from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.roles import StoreDsn

CLI = str(Path(sys.executable).parent / "es-pipeline")
pytestmark = pytest.mark.slow  # each command a process that loads Dagster: `make test`, not `make check`'s budget

V1 = '''
from es_pipeline.domain import Domain
domain = Domain("team")

@domain.reducer("cart", revision=1)
def cart(state, event):
    return {"items": int(state.get("items", 0)) + 1}
'''

V2 = V1 + '''

@domain.reducer("invoice", revision=1)
def invoice(state, event):
    return {"total": float(state.get("total", 0)) + float(event.payload["amount"])}
'''


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([CLI, *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def test_materialize_builds_a_new_stream_type_and_never_says_up_to_date_while_its_rebuild_waits(
    dsn: StoreDsn, tmp_path: Path,
) -> None:
    modules, warehouse = tmp_path / "modules", tmp_path / "warehouse"
    modules.mkdir()
    (modules / "team_v1.py").write_text(V1)
    (modules / "team_v2.py").write_text(V2)
    env = {"ES_PIPELINE_PG_DSN": dsn.extractor, "ES_PIPELINE_WAREHOUSE": str(warehouse),
           "DAGSTER_HOME": str(tmp_path / "dagster"), "PYTHONPATH": str(modules), "ES_PIPELINE_SLICE_RANGES": "1",
           "ES_PIPELINE_DOMAIN": "team_v1", "ES_PIPELINE_ENGINE": "local"}
    store = EventStore(dsn.writer)
    for n in range(3):
        store.append(f"cart-{n}", "cart", [NewEvent("ItemAdded", {"sku": "a"})] * 2, 0)
        store.append(f"invoice-{n}", "invoice", [NewEvent("Billed", {"amount": 1.5 * (n + 1)})], 0)
    assert "the lake is up to date:" in _cli(["materialize"], env).stdout

    # The team adds a reducer for invoices; held, the new type waits, and neither command says up to date.
    env |= {"ES_PIPELINE_DOMAIN": "team_v2", "ES_PIPELINE_REBUILDS": "hold"}
    held = _cli(["materialize"], env).stdout
    assert "the lake is up to date but for stream_state's invoice" in held and "lake is up to date:" not in held, held
    status = _cli(["status", "--no-dagster"], env).stdout
    assert "stream_state: not up to date for invoice" in status, status

    # By default, materialize runs the rebuild: every invoice folded, and up to date.
    del env["ES_PIPELINE_REBUILDS"]
    done = _cli(["materialize"], env).stdout
    assert "the lake is up to date:" in done, done
    rows = DeltaTable(str(warehouse / "stream_state")).to_pyarrow_table(columns=["stream_id", "state"]).to_pylist()
    states = {r["stream_id"]: json.loads(r["state"]) for r in rows if r["stream_id"].startswith("invoice-")}
    assert states == {f"invoice-{n}": {"total": 1.5 * (n + 1)} for n in range(3)}
    assert "not up to date" not in _cli(["status", "--no-dagster"], env).stdout


def test_a_reducer_that_fails_during_materialize_with_stop_is_one_line_and_quarantines_by_default(dsn: StoreDsn, tmp_path: Path) -> None:
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "team_bad.py").write_text(V1.replace('int(state.get("items", 0)) + 1',
                                                    'int(state.get("items", 0)) + int(event.payload["qty"])'))
    EventStore(dsn.writer).append("cart-7", "cart", [NewEvent("ItemAdded", {"sku": "a"})], 0)
    (tmp_path / "dagster").mkdir()  # an instance as the quickstart makes it (else Dagster's first-run notice)
    (tmp_path / "dagster" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {"ES_PIPELINE_PG_DSN": dsn.extractor, "ES_PIPELINE_WAREHOUSE": str(tmp_path / "warehouse"),
           "DAGSTER_HOME": str(tmp_path / "dagster"), "PYTHONPATH": str(modules), "ES_PIPELINE_SLICE_RANGES": "1",
           "ES_PIPELINE_DOMAIN": "team_bad", "ES_PIPELINE_ENGINE": "local", "ES_PIPELINE_FOLD_ERRORS": "stop"}
    done = subprocess.run([CLI, "materialize"], env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert "stream_state failed" in done.stderr and "stream 'cart-7' version 1" in done.stderr, done.stderr
    assert "DEBUG" not in done.stdout + done.stderr
    status = subprocess.run([CLI, "status"], env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
                            check=False)
    assert "stream_state failing on stream 'cart-7' version 1" in status.stdout, status.stdout + status.stderr

    # The default, quarantine: the stream held, every other table built, and never "up to date" while it is held.
    done = subprocess.run([CLI, "materialize"], env={**os.environ, **env, "ES_PIPELINE_FOLD_ERRORS": "quarantine"},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "quarantined_streams 1" in done.stdout and "up to date but for 1 quarantined in stream_state" in done.stdout, \
        done.stdout
