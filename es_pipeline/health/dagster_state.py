"""What Dagster's instance says about the pipeline's health: the daemon's heartbeats, the sensors' newest ticks,
the runs in progress (a tailing run alive), each job's newest run, each asset's newest materialization and check.

Read from the instance's storage (DAGSTER_HOME), never from a code location: a dead code server must show as one
here, not stop the reading.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
from dagster._core.scheduler.instigation import InstigatorStatus, InstigatorType, TickStatus

from es_pipeline.checks import BUILTIN
from es_pipeline.extraction.tail import TAIL_TAG

JOBS = ("events_job", "__ASSET_JOB", "snapshots_job", "lake_checks_job", "delta_maintenance_job")
SENSORS = ("new_events_sensor", "projections_automation_sensor")
# es_pipeline's built-in checks (es_pipeline/checks/), each a Dagster asset check of its name: (asset, check).
CHECKS = tuple((check.table, check.name) for check in BUILTIN)


def checks_of(assets: list[str]) -> list[tuple[str, str]]:
    """`CHECKS`, and the check of each other projection among `assets` (a team's cross-stream projection:
    `<name>_matches_events`, es_pipeline/checks/projections.py)."""
    held = {a for a, _ in CHECKS}
    return [*CHECKS, *((a, f"{a}_matches_events") for a in assets if a not in held and a != "event_tables")]


@dataclass(frozen=True)
class Tick:
    sensor: str
    running: bool  # the sensor is on
    at: float | None  # newest tick's time (seconds since the epoch)
    failed: bool  # the newest tick failed (a code server that does not answer, an error in the sensor)
    error: str = ""


@dataclass(frozen=True)
class LastRun:
    job: str
    status: str
    at: float  # when it ended (or was last updated)
    run_id: str


@dataclass(frozen=True)
class LastPass:
    """A range's newest `events` materialization (a one-pass run's, or a tailing run's report of its passes):
    when, the events it brought, and the mean seconds of a pass."""

    at: float
    events: int
    seconds: float


@dataclass(frozen=True)
class Failing:
    """An asset whose newest run failed, and that has not been materialized since: the step's first line, and
    the metadata of its `dg.Failure` (the stream, version and event type a reducer or a fold failed on)."""

    asset: str
    job: str
    run_id: str
    at: float
    error: str
    failure: dict[str, str] = field(default_factory=dict)


@dataclass
class DagsterReading:
    heartbeats: dict[str, float]  # daemon type → seconds since the epoch
    ticks: list[Tick]
    tailing_runs: list[tuple[str, float]]  # (run id, start) of the tailing runs Dagster has in progress
    last_runs: list[LastRun]
    failing: list[Failing]
    materialized: dict[str, float]  # asset → newest materialization's time
    checks: dict[tuple[str, str], bool]  # (asset, check) → passed, newest evaluation
    freshness: dict[str, str] = field(default_factory=dict)  # asset → its freshness policy's state (PASS, WARN, FAIL)
    passes: dict[str, LastPass] = field(default_factory=dict)  # range → its newest report of passes
    taken_at: float = 0.0


def open_instance() -> dg.DagsterInstance | None:
    """The Dagster instance DAGSTER_HOME names (`make dev` exports it); None where it names none."""
    home = os.environ.get("DAGSTER_HOME", "")
    if not home or not (Path(home) / "dagster.yaml").exists():
        return None
    return dg.DagsterInstance.from_config(home)


def read_dagster(instance: dg.DagsterInstance, assets: list[str], *, declared: dict[str, bool] | None = None,
                 ranges: list[str] | None = None) -> DagsterReading:
    """`declared`: sensor → whether it runs where its status is declared in code (the instance does not record
    which): the new-events sensor does, the automation sensor where ES_PIPELINE_AUTOMATION is on."""
    heartbeats = {kind: hb.timestamp for kind, hb in instance.get_daemon_heartbeats().items()}
    ticks = []
    for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
        if state.instigator_name not in SENSORS:
            continue
        newest = instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=1)
        tick = newest[0] if newest else None
        error = ""
        if tick is not None and tick.status == TickStatus.FAILURE and tick.error is not None:
            error = (tick.error.message or "").strip().splitlines()[0][:300] if tick.error.message else ""
        running = state.status == InstigatorStatus.RUNNING or (
            state.status == InstigatorStatus.DECLARED_IN_CODE and (declared or {}).get(state.instigator_name, True))
        ticks.append(Tick(state.instigator_name, running, None if tick is None else float(tick.timestamp),
                          tick is not None and tick.status == TickStatus.FAILURE, error))
    tailing = [
        (r.dagster_run.run_id, r.start_time or r.create_timestamp.timestamp())
        for r in instance.get_run_records(filters=dg.RunsFilter(
            job_name="events_job", statuses=[dg.DagsterRunStatus.STARTED]), limit=16)
        if r.dagster_run.tags.get(TAIL_TAG)
    ]
    last_runs = []
    for job in JOBS:
        records = instance.get_run_records(filters=dg.RunsFilter(job_name=job, statuses=ENDED), limit=1)
        if records:
            r = records[0]
            last_runs.append(LastRun(job, r.dagster_run.status.value, r.end_time or r.update_timestamp.timestamp(),
                                     r.dagster_run.run_id))
    keys = [dg.AssetKey(a) for a in assets]
    materialized = {
        key.to_user_string(): float(entry.timestamp)
        for key, entry in instance.get_latest_materialization_events(keys).items() if entry is not None
    }
    return DagsterReading(heartbeats, ticks, tailing, last_runs, _failing(instance, materialized, set(assets)),
                          materialized, _checks(instance, assets), _freshness(instance, keys), _passes(instance, ranges or []),
                          time.time())


def _passes(instance: dg.DagsterInstance, ranges: list[str]) -> dict[str, LastPass]:
    """Each range's newest `events` materialization (one query a range: its partition)."""
    out = {}
    for key in ranges:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("events"), asset_partitions=[key]), limit=1).records
        entry = records[0].event_log_entry if records else None
        m = entry.asset_materialization if entry is not None else None
        if entry is None or m is None:
            continue
        meta: dict[str, Any] = {k: getattr(v, "value", v) for k, v in m.metadata.items()}
        passes = int(meta.get("passes") or 1)
        out[key] = LastPass(float(entry.timestamp), int(meta.get("rows") or 0),
                            float(meta.get("total_seconds") or 0.0) / max(passes, 1))
    return out


def _freshness(instance: dg.DagsterInstance, keys: list[dg.AssetKey]) -> dict[str, str]:
    """Each asset's freshness state as Dagster's freshness daemon last recorded it (absent: none recorded yet)."""
    records = instance.get_freshness_state_records(keys)
    return {key.to_user_string(): str(getattr(r.freshness_state, "value", r.freshness_state))
            for key, r in records.items() if r is not None}


# A canceled run (a deploy, `make dev` stopped, Terminate) is neither: it says nothing of the job's health.
ENDED = [dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE]
FAILED_RUNS_READ = 5  # newest failed runs of the projections' and snapshots' jobs looked at, per job


def _failing(instance: dg.DagsterInstance, materialized: dict[str, float], assets: set[str]) -> list[Failing]:
    """The assets (projections, snapshots) whose newest failed step is newer than their newest materialization.
    A step is an asset's where its key is the asset's name (an asset check's step is not: the checks' results
    are `checks`)."""
    out: dict[str, Failing] = {}
    # The automation's and the UI's runs, `es-pipeline materialize`'s (`dg.materialize`: an ephemeral job), the snapshots'.
    for job in ("__ASSET_JOB", "__ephemeral_asset_job__", "snapshots_job"):
        for r in instance.get_run_records(filters=dg.RunsFilter(job_name=job, statuses=[dg.DagsterRunStatus.FAILURE]),
                                          limit=FAILED_RUNS_READ):
            at = r.end_time or r.update_timestamp.timestamp()
            for record in instance.get_records_for_run(r.dagster_run.run_id,
                                                       of_type=dg.DagsterEventType.STEP_FAILURE).records:
                event = record.event_log_entry.dagster_event
                asset = None if event is None else event.step_key
                if event is None or asset not in assets or asset in out or materialized.get(asset, 0.0) > at:
                    continue
                data = event.step_failure_data
                message = ((data.error.message if data and data.error else "") or "").strip()
                meta = data.user_failure_data.metadata if data and data.user_failure_data else {}
                out[asset] = Failing(asset, job, r.dagster_run.run_id, at, message.splitlines()[0][:300] if message else "",
                                     {k: str(getattr(v, "value", v)) for k, v in meta.items()})
    return sorted(out.values(), key=lambda f: f.asset)


def _checks(instance: dg.DagsterInstance, assets: list[str]) -> dict[tuple[str, str], bool]:
    """The newest finished evaluation of each of es_pipeline's checks of these assets (`checks_of`)."""
    keys = [dg.AssetCheckKey(dg.AssetKey(asset), name) for asset, name in checks_of(assets)]
    found = instance.event_log_storage.get_latest_asset_check_execution_by_key(keys)
    out = {}
    for key, record in found.items():
        status = str(getattr(record.status, "value", record.status))
        if status in ("SUCCEEDED", "FAILED"):  # PLANNED: in progress, or its run died
            out[(key.asset_key.to_user_string(), key.name)] = status == "SUCCEEDED"
    return out
