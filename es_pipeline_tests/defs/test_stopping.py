"""A run asked to stop (SIGTERM, SIGINT) ends as succeeded or canceled, never as failed; and a failed run reaches
the webhook of ES_PIPELINE_ALERT_WEBHOOK with the stream and version a reducer failed on. Real Dagster runs, in
this process (the signal is this process's own)."""


import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import dagster as dg
import pytest

from es_pipeline.defs import stopping
from es_pipeline.defs.health.sensor import WEBHOOK_ENV, post_failure
from es_pipeline.defs.stopping import projection_run, stop_requests
from es_pipeline.errors import DatabaseUnreachable, ReducerError


def _signal_soon(signum: int, after: float = 1.0) -> None:
    threading.Timer(after, os.kill, args=(os.getpid(), signum)).start()


@pytest.mark.slow  # make check's budget (3 min): make test's tier
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_pass_asked_to_stop_finishes_and_the_run_succeeds(signum: int) -> None:
    passes: list[int] = []

    @dg.asset
    def tailing(context: dg.AssetExecutionContext) -> None:
        with stop_requests(context, finish=True) as stop:
            _signal_soon(signum)
            while not stop.is_set():  # a pass a tenth of a second, as a tailing run's loop
                time.sleep(0.1)
                passes.append(1)
            time.sleep(0.3)  # the pass in progress ends after the signal: not interrupted
            passes.append(2)

    result = dg.materialize([tailing], instance=dg.DagsterInstance.ephemeral(), raise_on_error=False)
    assert result.success and passes[-1] == 2
    assert result.dagster_run.status == dg.DagsterRunStatus.SUCCESS


@pytest.mark.slow  # make check's budget (3 min): make test's tier
def test_a_pass_that_does_not_end_after_one_signal_is_interrupted_and_canceled(monkeypatch: pytest.MonkeyPatch) -> None:
    """One signal is all Terminate and run monitoring's time limit send: a pass that hangs still ends."""
    monkeypatch.setattr(stopping, "GRACE_SECONDS", 1.0)

    @dg.asset
    def hung(context: dg.AssetExecutionContext) -> None:
        with stop_requests(context, finish=True):
            _signal_soon(signal.SIGINT, 0.5)
            time.sleep(60)  # a lock wait: it never looks at the stop event

    instance = dg.DagsterInstance.ephemeral()
    began = time.monotonic()
    result = dg.materialize([hung], instance=instance, raise_on_error=False)
    assert time.monotonic() - began < 20
    assert instance.get_run_by_id(result.run_id).status == dg.DagsterRunStatus.CANCELED


def test_a_projection_asked_to_stop_is_canceled_not_failed() -> None:
    @dg.asset
    def projection(context: dg.AssetExecutionContext) -> None:
        with projection_run(context):
            _signal_soon(signal.SIGTERM)
            time.sleep(30)

    instance = dg.DagsterInstance.ephemeral()
    began = time.monotonic()
    result = dg.materialize([projection], instance=instance, raise_on_error=False)
    assert time.monotonic() - began < 20
    assert instance.get_run_by_id(result.run_id).status == dg.DagsterRunStatus.CANCELED


class _Hook(BaseHTTPRequestHandler):
    received: list[dict[str, str]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_reducer_failure_is_posted_with_its_stream_and_version(monkeypatch: pytest.MonkeyPatch) -> None:
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/hook/secret-token"
    monkeypatch.setenv(WEBHOOK_ENV, url)

    @dg.asset
    def stream_state(context: dg.AssetExecutionContext) -> None:
        with projection_run(context):
            raise ReducerError("account-7", 12, "Poisoned", "ValueError: bad card 4111-1111-1111-1111 in the payload")

    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize([stream_state], instance=instance, raise_on_error=False)
    run = instance.get_run_by_id(result.run_id)
    assert run is not None and run.status == dg.DagsterRunStatus.FAILURE
    failure = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)[0].dagster_event
    context = dg.build_run_status_sensor_context(
        sensor_name="run_failure_alert", dagster_instance=instance, dagster_run=run, dagster_event=failure,
    ).for_run_failure()
    post_failure(context)
    server.shutdown()
    (posted,) = _Hook.received
    assert (posted["stream_id"], posted["version"], posted["event_type"]) == ("account-7", "12", "Poisoned")
    assert "failed on stream 'account-7' version 12 (Poisoned)" in posted["text"]
    assert "failed with ValueError" in posted["error"]
    assert "4111" not in json.dumps(posted), "the reducer's words (which quote the payload) stay in the run's logs"
    (step_failed,) = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_FAILURE)
    assert "4111" in step_failed.dagster_event.step_failure_data.error.message  # the run keeps it, for its owner
    logs = " ".join(str(e.user_message) for e in instance.all_logs(run.run_id))
    assert "secret-token" not in logs + json.dumps(posted)


def test_a_cross_stream_run_whose_store_is_unreachable_fails_in_one_line(tmp_path: Path) -> None:
    """The store's frontier and turns are asked with a connect timeout; a store that does not answer fails the
    run with one line saying what to do, not a traceback."""
    from shop.domain import domain as shop

    from es_pipeline.defs.projections.assets import build_cross_stream_asset
    from es_pipeline.defs.resources import EventStoreResource, SparkResource, WarehouseResource
    from es_pipeline.extraction.offsets import batch_frontier
    from es_pipeline.lake.events import EVENTS

    nowhere = "host=127.0.0.1 port=1 dbname=es user=nobody connect_timeout=2"
    with pytest.raises(DatabaseUnreachable, match="cannot connect to PostgreSQL at 127.0.0.1:1"):
        batch_frontier(nowhere, "es")
    EVENTS.ensure_arrow(tmp_path)  # an `events` table, so that the run goes on to ask the store
    result = dg.materialize([build_cross_stream_asset(shop, "sku_sales")], raise_on_error=False, resources={
        "warehouse": WarehouseResource(path=str(tmp_path)), "event_store": EventStoreResource(dsn=nowhere),
        "spark": SparkResource(spark_config={})})  # lazy: no session is started
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    error = failure.step_failure_data.error
    assert error is not None and error.message.startswith("dagster._core.definitions.events.Failure: cannot connect")
    assert "Traceback" not in error.message
