"""The health drills, on the whole stack as `make dev` runs it (a Dagster daemon and code server on Postgres
storage, tailing runs, automation, a Spark Connect server), watched by a real Prometheus server that scrapes
`es-pipeline metrics` with es_pipeline's own alert rules (es_pipeline/health/alerts.yml):

1. a transaction held open while writers append: EsPipelineHorizonHeld fires once it has held 60 s, naming the
   holder's pid and application name (and `status` names it in its health line), and resolves when it ends;
2. a reducer that fails on an event: the stream is quarantined (ES_PIPELINE_FOLD_ERRORS=quarantine, the default),
   its `_dead_letters` row there, EsPipelineStreamsQuarantined fires naming the table (the message in no label),
   `status` says so, and no run of `stream_state` fails (with `stop`: EsPipelineProjectionFailing, a promtool test);
3. Spark Connect gone: EsPipelineSparkConnectDown within 60 s;
4. the tailing run SIGKILLed: EsPipelineEventsRunFailed within 60 s, then the next run catches up and the lake
   holds every committed event exactly once; then a projection's row changed by hand: its check fails
   (`stream_catalog_matches_events`) and EsPipelineProjectionCheckFailed fires within 60 s;
5. a tailing run sent SIGTERM (a deploy, `make dev` stopped) ends as succeeded, not failed;
6. the code server killed: EsPipelineSensorFailing (or SensorStalled) within 60 s, resolved when it is back; then
   the daemon killed: EsPipelineSensorStalled within 60 s, and EsPipelineDaemonDown.
Each alert's time to fire is printed (pytest -s) and bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

from es_pipeline.defs.checks import BUILTIN as CHECKS
from es_pipeline.defs.projections.assets import build_projection_assets
from es_pipeline.defs.resources import EventStoreResource, SparkResource, WarehouseResource
from es_pipeline.dev.stack import dagster_stack, free_port, wait_port
from es_pipeline.dev.workload import run_workload
from es_pipeline.domain import NO_DOMAIN
from es_pipeline.health.prometheus import Prometheus, prometheus
from es_pipeline.instance.launcher import PID_TAG
from es_pipeline.lake.kernel import dead_letters
from es_pipeline.settings import PROJECT_ROOT
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.lakecheck import assert_exactly_once_by_key
from es_pipeline_tests.support.roles import StoreDsn
from es_pipeline_tests.support.waiting import stack_doing, wait_for

CLI = str(Path(sys.executable).parent / "es-pipeline")


def _fires(prom: Prometheus, name: str, seconds: float, doing: Callable[[], str] | None = None,
           **labels: str) -> tuple[dict[str, Any], float]:
    """The first firing alert `name` with `labels`, and how long it took from now."""
    began = time.monotonic()
    alert = wait_for(lambda: [a for a in prom.firing(name) if all(a["labels"].get(k) == v for k, v in labels.items())],
                     seconds, f"{name}{labels} to fire", doing=doing)[0]
    took = time.monotonic() - began
    print(f"{name} fired after {took:.0f} s: {alert['annotations'].get('summary')}")
    return alert, took


def _runs_of(instance: dg.DagsterInstance, asset: str, created_after: float) -> list[dg.RunRecord]:
    """Runs that materialize `asset`, created after `created_after` (a time.time()), newest first."""
    records = instance.get_run_records(filters=dg.RunsFilter(
        created_after=datetime.fromtimestamp(created_after, tz=UTC)), limit=50)
    return [r for r in records if dg.AssetKey(asset) in (r.dagster_run.asset_selection or ())]


def _tailing_runs(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    return [r.dagster_run for r in instance.get_run_records(dg.RunsFilter(
        job_name="events_job", statuses=[dg.DagsterRunStatus.STARTED])) if PID_TAG in r.dagster_run.tags]


def _in_lake(warehouse: Path, stream_id: str, version: int) -> bool:
    from deltalake import DeltaTable

    from es_pipeline.lake.delta.current import files

    path = str(warehouse / "events")
    rows = files(path, DeltaTable(path)).to_table(columns=["stream_id", "version"]).to_pylist()
    return {"stream_id": stream_id, "version": version} in rows


def _count_one_more(path: Path, stream_id: str) -> bool:
    """One more event counted for `stream_id` than `events` holds, by hand; False when an update committed first."""
    try:
        DeltaTable(str(path)).update(updates={"events": "events + 1"}, predicate=f"stream_id = '{stream_id}'")
    except CommitFailedError:
        return False
    return True


def _health_line(env: dict[str, str]) -> str:
    out = subprocess.run([CLI, "status"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(2400)
def test_the_drills_fire_their_alerts_on_a_real_prometheus_and_lose_nothing(
    pg_server: str, dsn: StoreDsn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"ES_PIPELINE_TAIL_SECONDS": "60", "ES_PIPELINE_DOMAIN": "es_pipeline_tests.support.poison_domain",
           "ES_PIPELINE_FRESHNESS_SECONDS": "60", "PYTHONPATH": str(PROJECT_ROOT)}
    with dagster_stack(admin_dsn=pg_server, dsn=dsn.extractor, tmp=tmp_path, slice_ranges=2, sensor_interval=2,
                       connect=True, automation=True, extra_env=env) as stack:
        for key in ("DAGSTER_HOME", "DAGSTER_PG_URL"):
            monkeypatch.setenv(key, stack.env[key])
        instance = dg.DagsterInstance.get()
        connect, code_server, daemon = stack.processes
        port = free_port()
        exporter = subprocess.Popen([CLI, "metrics", "--port", str(port)], env=stack.env,
                                    stdout=open(tmp_path / "exporter.log", "wb"), stderr=subprocess.STDOUT)
        store = EventStore(dsn.writer)
        stop = threading.Event()
        writers = threading.Thread(target=run_workload, args=(store,), kwargs=dict(
            streams=60, events=None, writers=2, rollback_rate=0.1, max_commit_delay=0.1, rate=20.0, stop=stop))
        try:
            wait_port(port, 60)
            with prometheus([f"127.0.0.1:{port}"], tmp_path / "prometheus", port=free_port(), interval="2s") as prom:
                doing = stack_doing(instance, tmp_path / "logs", prom)
                writers.start()
                store.append("drill-1", "drill", [NewEvent("Opened", {})], 0)
                wait_for(lambda: prom.query("es_pipeline_tailing_run_alive == 1"), 180, "a tailing run alive", doing=doing)
                wait_for(lambda: len(prom.query("es_pipeline_asset_last_materialization_timestamp_seconds")) >= 5
                      and len(prom.query("es_pipeline_projection_behind_versions < 5")) == 4, 300,
                      "events and the four projections built (their first builds use Spark Connect) and kept", doing=doing)
                firing = [a["labels"]["alertname"] for a in prom.alerts() if a["state"] == "firing"]
                assert not firing, f"alerts firing on a healthy pipeline: {firing}"
                assert _health_line(stack.env).startswith("health: ok"), _health_line(stack.env)
                assert len(prom.query("es_pipeline_range_last_pass_timestamp_seconds")) == 2  # a report per range
                for r in prom.query("max_over_time(es_pipeline_dagster_daemon_heartbeat_age_seconds[10m])"):
                    print(f"daemon {r['metric']['daemon']}: heartbeat at most {float(r['value'][1]):.0f} s old")

                # 1-3 at once: a poisoned stream (in the lake first: a held horizon would keep it out), a held
                # transaction, Spark Connect gone.
                store.append("drill-1", "drill", [NewEvent("Poisoned", {})], 1)
                wait_for(lambda: _in_lake(stack.warehouse, "drill-1", 2), 60, "the poisoned event in the lake",
                         doing=doing)
                in_lake_at = time.time()
                holder = psycopg.connect(dsn.writer, application_name="drill-holder")
                holder.execute("SELECT pg_current_xact_id()")
                held_since = time.time()
                os.killpg(connect.pid, signal.SIGKILL)  # the first builds are done: nothing needs Spark now
                _, took = _fires(prom, "EsPipelineSparkConnectDown", 90, doing)
                assert took <= 60
                assert "Spark Connect at" in _health_line(stack.env)
                # The poisoned event reaches stream_state through a chain; each link waited for on its own, bounded by
                # what it takes: the tailing run's follow (or the automation's run of stream_state) folds it, and
                # quarantines drill-1 alone (ES_PIPELINE_FOLD_ERRORS=quarantine, the default): the update commits every
                # other stream, `_dead_letters` gains drill-1's row, the exporter reads it (5 s), Prometheus scrapes
                # (2 s) and fires. The team's message is in the lake, never in a label.
                quarantined, took = _fires(prom, "EsPipelineStreamsQuarantined", 420, doing, projection="stream_state")
                print(f"drill-1 quarantined, alerted {time.time() - in_lake_at:.0f} s after the poisoned event reached "
                      "the lake")
                assert "cannot fold" not in json.dumps(quarantined["labels"])
                [letter] = dead_letters.rows_of(stack.warehouse).to_pylist()
                assert (letter["key"], letter["version"], letter["event_type"], letter["error_kind"]) == (
                    "drill-1", 2, "Poisoned", "ValueError")
                assert "stream_state: 1 quarantined" in _health_line(stack.env)
                assert not [r for r in _runs_of(instance, "stream_state", in_lake_at)
                            if r.dagster_run.status == dg.DagsterRunStatus.FAILURE], "quarantine fails no run"
                held, _ = _fires(prom, "EsPipelineHorizonHeld", 180, doing)
                # When it fired (no `for`: when it became active), not when this drill came to look.
                fired = datetime.fromisoformat(held["activeAt"].replace("Z", "+00:00")).timestamp() - held_since
                assert held["labels"]["pid"] == str(holder.info.backend_pid)
                assert held["labels"]["application_name"] == "drill-holder"
                assert fired <= 60 + 60, f"the held horizon alerted {fired:.0f} s after the hold began"
                line = _health_line(stack.env)
                assert f"pid {holder.info.backend_pid} 'drill-holder'" in line, line
                holder.commit()
                holder.close()
                wait_for(lambda: not prom.firing("EsPipelineHorizonHeld"), 60, "the held horizon's alert to resolve", doing=doing)

                # 4: the tailing run SIGKILLed; the next one catches up.
                run = wait_for(lambda: _tailing_runs(instance), 120, "a tailing run", doing=doing)[0]
                os.kill(int(run.tags[PID_TAG]), signal.SIGKILL)
                _, took = _fires(prom, "EsPipelineEventsRunFailed", 120, doing)
                assert took <= 60
                wait_for(lambda: [r for r in _tailing_runs(instance) if r.run_id != run.run_id], 120, "the next tailing run",
                         doing=doing)
                stop.set()
                writers.join()
                wait_for(lambda: prom.query('sum(es_pipeline_events_waiting) == 0'), 120, "every event extracted",
                         doing=doing)
                assert assert_exactly_once_by_key(stack.warehouse, dsn) > 0

                # 4b: a projection that no longer matches `events` (a row changed by hand): its check fails and pages.
                wait_for(lambda: _count_one_more(stack.warehouse / "stream_catalog", "drill-1"), 60,
                         "stream_catalog's row of drill-1 changed by hand", doing=doing)
                checked = dg.materialize(
                    [_asset("stream_catalog"), CHECKS["stream_catalog_matches_events"]], instance=instance,
                    selection=dg.AssetSelection.checks(CHECKS["stream_catalog_matches_events"]),
                    resources={"warehouse": WarehouseResource(path=str(stack.warehouse)),
                               "spark": SparkResource(spark_config={}), "event_store": EventStoreResource(dsn=dsn.extractor)})
                [evaluation] = checked.get_asset_check_evaluations()
                assert not evaluation.passed and "drill-1" in evaluation.metadata["examples"].value
                _, took = _fires(prom, "EsPipelineProjectionCheckFailed", 60, doing, asset="stream_catalog")
                print(f"EsPipelineProjectionCheckFailed fired {took:.0f} s after the check failed")

                # 5: a tailing run asked to stop ends as succeeded.
                run = wait_for(lambda: _tailing_runs(instance), 120, "a tailing run", doing=doing)[0]
                os.kill(int(run.tags[PID_TAG]), signal.SIGTERM)
                ended = wait_for(lambda: (r := instance.get_run_by_id(run.run_id)) and r.is_finished and r, 60,
                              "the run asked to stop to end", doing=doing)
                assert ended.status == dg.DagsterRunStatus.SUCCESS, ended.status

                # 6: the code server; then the daemon.
                os.killpg(code_server.pid, signal.SIGKILL)
                killed = time.monotonic()
                name = wait_for(lambda: [a["labels"]["alertname"] for a in prom.alerts() if a["state"] == "firing" and
                                      a["labels"]["alertname"] in ("EsPipelineSensorStalled", "EsPipelineSensorFailing")
                                      and a["labels"].get("sensor") == "new_events_sensor"], 120,
                             "the sensor's alert once its code server is gone", doing=doing)[0]
                print(f"{name} fired {time.monotonic() - killed:.0f} s after the code server was killed")
                assert time.monotonic() - killed <= 60
                line = _health_line(stack.env)
                assert line.startswith("health: PROBLEM") and "sensor new_events_sensor" in line, line
                # the code server back (as `dagster dev` restarts its own): the sensor ticks again
                stack.processes.append(subprocess.Popen(
                    code_server.args, env=stack.env, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL,
                    stderr=subprocess.STDOUT, start_new_session=True))
                wait_for(lambda: not [a for a in prom.alerts() if a["state"] == "firing" and a["labels"]["alertname"]
                                   in ("EsPipelineSensorStalled", "EsPipelineSensorFailing")], 180,
                      "the sensor's alerts to resolve once its code server is back", doing=doing)
                os.killpg(daemon.pid, signal.SIGKILL)
                _, took = _fires(prom, "EsPipelineSensorStalled", 120, doing, sensor="new_events_sensor")
                assert took <= 60  # a dead daemon shows first as its sensor's stall
                _, took = _fires(prom, "EsPipelineDaemonDown", 150, doing)
                assert "silent" in _health_line(stack.env)
        finally:
            stop.set()
            exporter.terminate()
            exporter.wait(30)


def _asset(name: str) -> dg.AssetsDefinition:
    return next(a for a in build_projection_assets(NO_DOMAIN) if a.key.to_user_string() == name)
