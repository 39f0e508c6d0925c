"""The exporter's reading against a real store and lake, as the extractor role: a held transaction is named
(pid, application name, user) while writers append behind it, its events reach the lake exactly once after it
ends; commit→lake latency and projection distances come from the Delta log; the CLI serves and prints them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from es_pipeline.dev.workload import run_workload
from es_pipeline.domain import Domain
from es_pipeline.extraction.extractor import Extractor
from es_pipeline.extraction.slices import SliceRange
from es_pipeline.health import watch
from es_pipeline.health.exporter import ALERTS, Reader, registry_for
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.typed import event_tables
from es_pipeline.settings import Settings
from es_pipeline.store.event_store import EventStore, NewEvent
from es_pipeline_tests.support.lakecheck import assert_exactly_once_by_key
from es_pipeline_tests.support.roles import StoreDsn

ALL = SliceRange(0, 1023)


def _samples(reader: Reader) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry_for(reader)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    found = [v for (n, ls), v in samples.items() if n == name and all((k, v2) in ls for k, v2 in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def test_a_held_transaction_is_named_and_the_events_behind_it_reach_the_lake_once_it_ends(
    dsn: StoreDsn, settings: Settings, warehouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = replace(settings, tail_seconds=0, slice_ranges=2)
    extractor = Extractor(dsn.extractor, None, warehouse)
    store = EventStore(dsn.writer)
    store.append("before-1", "account", [NewEvent("Opened", {"n": 1})], 0)
    extractor.run(ALL)
    reader = Reader(settings, dagster=False)
    first = _samples(reader)  # the latency histogram counts the commits after the first reading
    assert _value(first, "es_pipeline_reading_ok", part="store") == 1.0
    assert _value(first, "es_pipeline_source_ok") == 1.0

    holder = psycopg.connect(dsn.writer, application_name="drill-holder")
    holder.execute("SELECT pg_current_xact_id()")  # an id: the horizon stays below it until it ends
    holder_pid = holder.info.backend_pid
    stop = threading.Event()
    writers = threading.Thread(target=run_workload, args=(store,), kwargs=dict(
        streams=30, events=400, writers=3, rollback_rate=0.1, max_commit_delay=0.02, seed=7, stop=stop))
    writers.start()
    writers.join(60)
    extractor.run(ALL)  # takes nothing committed after the holder began
    reading = reader.reading(min_interval=0)
    s = reading.store
    assert s is not None and s.holder is not None
    assert (s.holder.pid, s.holder.application_name, s.holder.kind) == (holder_pid, "drill-holder", "session")
    assert s.holder.user == dsn.logins["es_pipeline_writer"] and s.holder.seconds is not None
    assert sum(r.waiting.behind_horizon for r in s.ranges) > 300
    assert sum(r.waiting.extractable for r in s.ranges) == 0
    samples = _samples(reader)
    held = [ls for (n, ls), _ in samples.items() if n == "es_pipeline_horizon_held_seconds"]
    assert len(held) == 1 and ("application_name", "drill-holder") in held[0] and ("pid", str(holder_pid)) in held[0]
    monkeypatch.setattr(watch, "HELD_LATE", 0.0)
    line = watch.health_line(reader.reading(min_interval=0), tailing=False)
    assert line.startswith("health: PROBLEM") and f"pid {holder_pid} 'drill-holder'" in line, line

    holder.commit()
    holder.close()
    assert extractor.run(ALL).rows > 300
    after = reader.reading(min_interval=0)
    assert after.store is not None and after.store.holder is None or after.store.holder.application_name != "drill-holder"
    assert sum(r.waiting.behind_horizon + r.waiting.extractable for r in after.store.ranges) == 0
    assert assert_exactly_once_by_key(warehouse, dsn) == 401
    samples = _samples(reader)
    # one `events` commit since the first reading (the pass while the holder held took nothing: no commit)
    assert _value(samples, "es_pipeline_commit_to_lake_seconds_count") == 1
    assert 0 < _value(samples, "es_pipeline_commit_to_lake_seconds_sum") < 120
    assert _value(samples, "es_pipeline_lake_events_appended_total") == 400
    assert not [n for (n, _), _ in samples.items() if n == "es_pipeline_horizon_held_seconds"]


def test_projection_distance_comes_from_the_delta_log(dsn: StoreDsn, settings: Settings, warehouse: Path) -> None:
    store = EventStore(dsn.writer)
    store.append("a-1", "account", [NewEvent("Opened", {"n": 1})], 0)
    extractor = Extractor(dsn.extractor, None, warehouse)
    extractor.run(ALL)
    event_tables.update(warehouse, Domain("plain"), store_dsn=dsn.extractor)
    reader = Reader(replace(settings, slice_ranges=2), dagster=False)
    behind = {b.name: b for b in reader.reading(min_interval=0).behind}
    assert behind["event_tables"].versions == 0 and behind["event_tables"].seconds == 0
    assert behind["stream_state"].folded is None  # never built: every commit of `events` is behind
    store.append("a-1", "account", [NewEvent("Renamed", {"n": 2})], 1)
    extractor.run(ALL)
    time.sleep(1.1)
    behind = {b.name: b for b in reader.reading(min_interval=0).behind}
    assert behind["event_tables"].versions == 1 and behind["event_tables"].seconds >= 1.0


def test_each_table_has_its_commit_to_table_latency(dsn: StoreDsn, settings: Settings, warehouse: Path) -> None:
    """`events` observes each commit's oldest event's wait until the Delta commit; a projection, until its own commit
    that folded it: the typed event tables folded a second after the extraction wait that second more."""
    store = EventStore(dsn.writer)
    store.append("a-1", "account", [NewEvent("Opened", {"n": 1})], 0)
    extractor = Extractor(dsn.extractor, None, warehouse)
    extractor.run(ALL)
    event_tables.update(warehouse, Domain("plain"), store_dsn=dsn.extractor)
    reader = Reader(replace(settings, slice_ranges=2, latency_bound_seconds=7), dagster=False)
    reader.reading(min_interval=0)  # what came before the exporter is not observed
    for n in (2, 3):
        store.append("a-1", "account", [NewEvent("Renamed", {"n": n})], n - 1)
        extractor.run(ALL)
    time.sleep(1.2)
    event_tables.update(warehouse, Domain("plain"), store_dsn=dsn.extractor)
    reader.reading(min_interval=0)
    samples = _samples(reader)
    assert _value(samples, "es_pipeline_commit_to_table_seconds_count", table="events") == 2
    assert _value(samples, "es_pipeline_commit_to_table_seconds_count", table="event_tables") == 2
    events_sum = _value(samples, "es_pipeline_commit_to_table_seconds_sum", table="events")
    typed_sum = _value(samples, "es_pipeline_commit_to_table_seconds_sum", table="event_tables")
    assert typed_sum >= events_sum + 2 * 1.2 - 0.1 and typed_sum < 60
    assert _value(samples, "es_pipeline_latency_bound_seconds", consumer="events") == 7
    assert _value(samples, "es_pipeline_commit_to_lake_seconds_count") == 2  # the older name, kept


@pytest.mark.slow  # three processes, each importing the CLI's command (8 s): not in `make check`
def test_the_cli_prints_a_scrape_the_rules_and_a_health_line(dsn: StoreDsn, warehouse: Path) -> None:
    env = {**os.environ, "ES_PIPELINE_PG_DSN": dsn.extractor, "ES_PIPELINE_WAREHOUSE": str(warehouse),
           "ES_PIPELINE_TAIL_SECONDS": "0", "DAGSTER_HOME": ""}
    cli = [str(Path(sys.executable).parent / "es-pipeline")]
    once = subprocess.run([*cli, "metrics", "--once"], env=env, capture_output=True, text=True, timeout=120)
    assert once.returncode == 0, once.stderr
    names = {f.name for f in text_string_to_metric_families(once.stdout)}
    assert {"es_pipeline_horizon", "es_pipeline_events_waiting", "es_pipeline_tailing_run_alive",
            "process_cpu_seconds"} <= names
    password = psycopg.conninfo.conninfo_to_dict(dsn.extractor).get("password")
    assert not password or str(password) not in once.stdout + once.stderr
    rules = subprocess.run([*cli, "metrics", "--rules"], env=env, capture_output=True, text=True, timeout=60)
    assert rules.stdout == ALERTS.read_text()
    status = subprocess.run([*cli, "status"], env=env, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[-1].startswith("health: ok"), status.stdout


def test_no_metric_takes_a_label_prometheus_sets_itself() -> None:
    """`job` and `instance` are the scrape's own labels: an exported one is renamed `exported_job` and every
    alert matching it goes silent (the health drill found `job` on the job metrics once)."""
    from es_pipeline.health.dagster_state import DagsterReading, Failing, LastPass, LastRun, Tick
    from es_pipeline.health.exporter import Latency, Reading, dagster_metrics, lake_metrics

    d = DagsterReading({"SENSOR": 1.0}, [Tick("new_events_sensor", True, 1.0, False)], [("r", 1.0)],
                       [LastRun("events_job", "FAILURE", 1.0, "r")], [Failing("stream_state", "__ASSET_JOB", "r", 1.0, "e")],
                       {"events": 1.0}, {("events", "events_no_duplicates"): True}, {"events": "PASS"},
                       {"0000-0511": LastPass(1.0, 3, 0.2)}, taken_at=2.0)
    families = [*dagster_metrics(d, "events"), *lake_metrics(Reading(events_version=3), "events", Latency())]
    labels = {name for f in families for s in f.samples for name in s.labels}
    assert labels and not labels & {"job", "instance"}, labels


@pytest.mark.slow  # make check's budget (3 min): make test's tier
def test_status_watch_draws_lag_holder_throughput_and_projections(
    dsn: StoreDsn, settings: Settings, warehouse: Path
) -> None:
    import io

    store = EventStore(dsn.writer)
    store.append("w-1", "account", [NewEvent("Opened", {"n": 1})], 0)
    extractor = Extractor(dsn.extractor, None, warehouse)
    extractor.run(ALL)
    event_tables.update(warehouse, Domain("plain"), store_dsn=dsn.extractor)
    reader = Reader(replace(settings, slice_ranges=2, tail_seconds=0), dagster=False)
    out = io.StringIO()
    stop = threading.Event()
    appended = threading.Thread(target=lambda: (time.sleep(0.3), store.append(
        "w-1", "account", [NewEvent("Renamed", {"n": i}) for i in range(2, 12)], 1), extractor.run(ALL)))
    appended.start()
    watch.watch(reader, interval=1.0, stop=stop, out=out, rounds=3)
    appended.join()
    frames = out.getvalue().split("es_pipeline 20")[1:]
    assert len(frames) == 3
    assert "0000-0511" in frames[0] and "horizon" in frames[0] and "event_tables" in frames[0]
    assert all(f.rstrip().splitlines()[-1].startswith("health: ok") for f in frames)
    rates = [float(m.group(1).replace(",", "")) for f in frames[1:] if (m := re.search(r"into the lake: ([\d,.]+)", f))]
    assert len(rates) == 2 and max(rates) > 0, rates  # the 10 events appended between two frames


@pytest.mark.slow  # make check's budget (3 min): make test's tier
def test_the_write_back_backlog_counts_the_latest_snapshots_the_store_lacks(
    dsn: StoreDsn, settings: Settings, warehouse: Path
) -> None:
    from shop.domain import domain as shop

    from es_pipeline.lake.state.snapshots import take_snapshots
    from es_pipeline.lake.state.stream_state import update_stream_state

    run_workload(EventStore(dsn.writer), streams=10, events=300, writers=1, rollback_rate=0, max_commit_delay=0)
    Extractor(dsn.extractor, None, warehouse).run(ALL)
    update_stream_state(Engine(), warehouse, domain=shop)  # small: no JVM
    taken = take_snapshots(Engine(), warehouse, EventStore.for_source(dsn.snapshots, settings.source), threshold=5)
    assert taken.figures["written_back"] > 3
    assert Reader(replace(settings, slice_ranges=2), dagster=False).reading(0).snapshot_backlog == 0
    with psycopg.connect(dsn) as conn:
        conn.execute("DELETE FROM es.snapshots WHERE stream_id IN (SELECT stream_id FROM es.snapshots LIMIT 3)")
    assert Reader(replace(settings, slice_ranges=2), dagster=False).reading(0).snapshot_backlog == 3


def test_a_rebuild_under_way_is_drawn_by_status_and_exported_with_its_expected_end() -> None:
    """lake/state/rebuild.py's `Progress` in `es-pipeline status` (one line per rebuild) and in the gauges."""
    from datetime import UTC, datetime

    from es_pipeline.health.exporter import Latency, Reading, lake_metrics
    from es_pipeline.health.watch import render
    from es_pipeline.lake.state.rebuild import Progress

    started, end = datetime(2026, 11, 27, 9, 0, tzinfo=UTC), datetime(2026, 11, 27, 9, 30, tzinfo=UTC)
    found = Progress("cart", "pieces", 2_500_000, 5_000_000, 2, 4, 17, started, end)
    text = render(Reading(rebuilds=[found]), tailing=True, throughput=None)
    assert "rebuilding beside stream_state" in text
    assert "cart: pieces, 2,500,000 of 5,000,000 events folded (50%; piece 2 of 4), started 2026-11-27 09:00:00 " \
        "UTC, expected end 2026-11-27 09:30:00 UTC" in text
    families = {f.name: f for f in lake_metrics(Reading(rebuilds=[found]), "events", Latency())}
    assert families["es_pipeline_rebuild_events_total"].samples[0].value == 5_000_000
    assert families["es_pipeline_rebuild_expected_end_timestamp_seconds"].samples[0].value == end.timestamp()
    assert not [f for f in lake_metrics(Reading(), "events", Latency()) if f.name.startswith("es_pipeline_rebuild")
                and f.samples]


def test_quarantined_streams_are_a_gauge_per_table_and_a_problem_in_the_health_line() -> None:
    """`_dead_letters`' count per table (the exporter's reading) as `es_pipeline_quarantined`, 0 for every other
    table it watches (so the alert resolves), and a problem in `status`'s health line; the message in neither."""
    from es_pipeline.health.exporter import Latency, Reading, lake_metrics
    from es_pipeline.lake.read.behind import Behind

    behind = [Behind("stream_state", 5, 0, 0.0), Behind("stream_catalog", 5, 0, 0.0)]
    r = Reading(behind=behind, quarantined={"stream_state": 2})
    [family] = [f for f in lake_metrics(r, "events", Latency()) if f.name == "es_pipeline_quarantined"]
    assert {s.labels["projection"]: s.value for s in family.samples} == {"stream_state": 2.0, "stream_catalog": 0.0}
    line = watch.health_line(r, tailing=False)
    assert line.startswith("health: PROBLEM") and "stream_state: 2 quarantined (es-pipeline lake quarantined)" in line
    assert "quarantined" not in watch.health_line(Reading(behind=behind), tailing=False)
