"""`run_failure_alert`: every failed run of the code location, posted to a webhook (Slack's incoming webhooks, or
any receiver of JSON) when ES_PIPELINE_ALERT_WEBHOOK names one. The path from a red run to a person, for a
Dagster deployment without Dagster+'s alert policies (docs/deploy.md, "Alerts").

The URL is read from the environment when a failure is posted, never stored: Dagster's storage, the UI and the
logs show the variable's name at most (a Slack webhook's URL is a secret). A post that fails is logged in the
sensor's tick and not retried: the run stays failed in the UI, and the Prometheus alerts (es_pipeline/health)
do not depend on it.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

import dagster as dg

WEBHOOK_ENV = "ES_PIPELINE_ALERT_WEBHOOK"
QUIET_SECONDS = 3600.0  # the same failure (job, asset, stream, version, first line) is posted once in this long
_posted: dict[tuple[str, ...], float] = {}  # in the code server's process: what was posted when
UI_ENV = "ES_PIPELINE_DAGSTER_URL"  # the UI's address, for the link in the message (optional)


def message(run: dg.DagsterRun, error: str, failure: dict[str, str]) -> dict[str, str]:
    """The JSON posted: `text` (what Slack shows) and the fields a receiver may route on."""
    where = (f" on stream {failure['stream_id']!r} version {failure.get('version', '?')} "
             f"({failure.get('event_type', '')})" if failure.get("stream_id") else "")
    ui = os.environ.get(UI_ENV, "").rstrip("/")
    link = f" {ui}/runs/{run.run_id}" if ui else ""
    return {"text": f"es_pipeline: run {run.run_id[:8]} of {run.job_name} failed{where}: {error}{link}",
            "run_id": run.run_id, "job": run.job_name, "error": error, **failure}


def build_run_failure_alert() -> dg.SensorDefinition:
    """On where ES_PIPELINE_ALERT_WEBHOOK is set when the code location loads (no tick every 30 s for nothing
    elsewhere); the UI can turn it on or off either way."""
    return dg.run_failure_sensor(
        name="run_failure_alert", minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING if os.environ.get(WEBHOOK_ENV) else dg.DefaultSensorStatus.STOPPED,
        description=f"Posts every failed run to the webhook {WEBHOOK_ENV} names (Slack, or any JSON receiver). The "
        "URL is read from the environment, never stored.",
    )(post_failure)


def post_failure(context: dg.RunFailureSensorContext) -> dg.SkipReason | None:
    url = os.environ.get(WEBHOOK_ENV, "")
    if not url:
        return dg.SkipReason(f"{WEBHOOK_ENV} is not set: failures are not posted")
    error, failure = "", {}
    for event in context.get_step_failure_events():
        data = event.step_failure_data
        error = ((data.error.message if data.error else "") or "").strip().splitlines()[0][:300] if data else ""
        if data and data.user_failure_data:
            failure = {k: str(getattr(v, "value", v)) for k, v in data.user_failure_data.metadata.items()}
        break
    if not error:
        error = (context.failure_event.message or "").strip().splitlines()[0][:300]
    if failure.get("stream_id"):
        # A reducer's or a fold's own words may quote the event's payload: they stay in the run's logs. The post
        # says where it failed (stream, version, event type) and what kind of error, never the text.
        reason = failure.pop("reason", "")
        kind = reason.split(":", 1)[0] if ":" in reason and " " not in reason.split(":", 1)[0] else "an error"
        error = (f"the fold failed with {kind} (its message, which may quote the payload, is in the run's logs, "
                 "not here)")
    # A poisoned projection fails again on every automation tick (30 s): one post per failure an hour, not a flood.
    key = (context.dagster_run.job_name, error, *(f"{k}={v}" for k, v in sorted(failure.items())))
    now = time.monotonic()
    if now - _posted.get(key, -QUIET_SECONDS) < QUIET_SECONDS:
        return dg.SkipReason(f"the same failure was posted less than {QUIET_SECONDS:.0f} s ago")
    _posted[key] = now
    body = json.dumps(message(context.dagster_run, error, failure)).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            context.log.info(f"run {context.dagster_run.run_id} posted to {WEBHOOK_ENV} ({answer.status})")
    except OSError as exc:  # the URL is not in the message: only where it was read from
        context.log.warning(f"could not post run {context.dagster_run.run_id} to {WEBHOOK_ENV}: {type(exc).__name__}")
    return None
