"""`es-pipeline metrics`: the pipeline's health in Prometheus's exposition format (prometheus_client).

A scrape takes one `Reading` (cached for `min_interval` seconds, so two Prometheus servers or a person's
`curl` cost one): the store (health/store.py), the lake's logs (lake/read/behind.py) and Dagster's instance
(health/dagster_state.py), each optional, each failing alone (`es_pipeline_reading_ok{part}` says which).
Labels are bounded: `consumer` (one per exporter), `range` (the slice ranges, 8 by default), `projection`
and `asset` (the lake's tables), `job`, `sensor`, `daemon`; the horizon's holder is one series at a time.
docs/operations.md lists every metric and the alerts (health/alerts.yml) built on them.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from es_pipeline.extraction.slices import split
from es_pipeline.health.store import StoreReading, read_store
from es_pipeline.lake.kernel import dead_letters
from es_pipeline.lake.read.behind import Behind, Lake
from es_pipeline.lake.state import history, rebuild
from es_pipeline.settings import DEFAULT_LATENCY_BOUND_SECONDS, Settings
from es_pipeline.store.conninfo import KeptConnection

log = logging.getLogger(__name__)

ALERTS = Path(__file__).with_name("alerts.yml")  # the Prometheus alert rules over these metrics
DEFAULT_PORT = 9464  # https://github.com/prometheus/prometheus/wiki/Default-port-allocations: free in that list
AUTOMATION_INTERVAL = 60  # seconds: projections_automation_sensor's minimum interval (defs/projections/automation.py)
MIN_INTERVAL = 5.0
BACKLOG_EVERY = 600  # seconds: the write-back backlog is read again at least this often (a snapshots run's cadence)  # seconds a reading is served again before a new one is taken
LATENCY_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 900.0, float("inf"))


@dataclass
class Reading:
    store: StoreReading | None = None
    behind: list[Behind] = field(default_factory=list)
    events_version: int | None = None
    dagster: Any = None  # health.dagster_state.DagsterReading, when an instance is configured
    spark_connect: tuple[str, bool] | None = None  # (host:port, answering) when ES_PIPELINE_SPARK_REMOTE is set
    snapshot_backlog: int | None = None  # streams whose latest snapshot in the lake the store lacks
    rebuilds: list[rebuild.Progress] = field(default_factory=list)  # rebuilds beside stream_state under way
    quarantined: dict[str, int] = field(default_factory=dict)  # table → streams or keys in `_dead_letters`
    keyless: dict[str, int] = field(default_factory=dict)  # table → events whose key could not be read
    ok: dict[str, bool] = field(default_factory=dict)  # part → read without error
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0  # what the reading cost, wall clock
    at: float = 0.0


class Histogram:
    """Counts of observations per LATENCY_BUCKETS bound (each in every bound it fits: cumulative, as Prometheus's
    format wants), their sum and number."""

    def __init__(self) -> None:
        self.counts = [0] * len(LATENCY_BUCKETS)
        self.total = 0.0
        self.n = 0

    def add(self, seconds: float) -> None:
        self.n += 1
        self.total += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1

    def buckets(self) -> list[tuple[str, float]]:
        """(le, count) pairs, as a HistogramMetricFamily takes them."""
        return [("+Inf" if bound == float("inf") else repr(bound), float(n))
                for bound, n in zip(LATENCY_BUCKETS, self.counts, strict=True)]


class Latency:
    """The commit→table histograms, cumulative over the exporter's life, one per table: `events` gets one
    observation per commit (its oldest event's wait, from `recorded_at` to the Delta commit); each projection one
    per `events` commit it folded (that commit's oldest event's wait until the projection's commit that folded
    it), read from the commits the tables gained since the last reading (their log entries: no row is read)."""

    KEEP = 5000  # `events` commits whose oldest event time is kept for the projections still to fold them

    def __init__(self) -> None:
        self.events = Histogram()
        self.tables: dict[str, Histogram] = {}
        self.rows = 0  # events the observed commits appended
        self.seen: int | None = None
        self.oldest: dict[int, float] = {}  # `events` version → its oldest event's recorded_at (epoch seconds)
        self.table_seen: dict[str, int] = {}  # projection → its table's version read up to
        self.folded: dict[str, int] = {}  # projection → the `events` version its last observed commit folded

    def observe(self, lake: Lake, newest: int | None, cursors: dict[str, Any] | None = None,
                folded: dict[str, int | None] | None = None) -> None:
        """What `events` and each projection (`cursors`, `folded`: the lake's, from this reading) gained since the
        last reading."""
        if newest is None:
            return
        if self.seen is None:  # history is not ours to count: from the commits after the first reading on
            self.seen = newest
        else:
            commits = lake.commits(newest)
            for version, seconds, rows in lake.commit_latencies(self.seen, upto=newest):
                self.rows += rows
                self.events.add(seconds)
                if version in commits:
                    self.oldest[version] = commits[version][0] - seconds
            self.seen = newest
        for name, cursor in (cursors or {}).items():
            self._observe_table(lake, name, cursor, (folded or {}).get(name))
        for version in [v for v in self.oldest if v <= newest - self.KEEP]:
            del self.oldest[version]

    def _observe_table(self, lake: Lake, name: str, cursor: Any, folded_now: int | None) -> None:
        table = None if cursor is None else lake.table(cursor[0])  # kept open by the lake: only its new log entries are read
        if table is None:
            return
        version = int(table.version())
        if name not in self.table_seen:  # from this reading on, as for `events`
            self.table_seen[name], self.folded[name] = version, -1 if folded_now is None else folded_now
            return
        histogram = self.tables.setdefault(name, Histogram())
        for _, committed, folded in lake.folds(cursor, self.table_seen[name], version):
            for v in range(self.folded[name] + 1, folded + 1):
                if v in self.oldest:  # commits that added events (and were observed by this exporter)
                    histogram.add(max(0.0, committed - self.oldest[v]))
            self.folded[name] = max(self.folded[name], folded)
        self.table_seen[name] = version


class Reader:
    """Takes readings for `settings`: one kept connection to the store, the lake's tables kept open, the instance."""

    def __init__(self, settings: Settings, *, instance: Any = None, dagster: bool = True) -> None:
        self.settings = settings
        self.source = settings.source
        self.ranges = split(settings.slice_ranges)
        self.kept = KeptConnection(settings.pg_dsn, "es_pipeline metrics")
        self.lake = Lake(settings.warehouse, grains=history.grains_of(settings.domain_modules))
        self.latency = Latency()
        self._instance = instance
        self._dagster = dagster
        self._lock = threading.Lock()
        self._last: Reading | None = None
        # The sensors' intervals and whether each runs where its status is declared in code, as the code location
        # sets them from the same settings (defs/events/sensor.py, defs/projections/automation.py).
        self.intervals = {"new_events_sensor": float(settings.sensor_interval_seconds),
                          "projections_automation_sensor": float(AUTOMATION_INTERVAL)}
        self.declared = {"new_events_sensor": True, "projections_automation_sensor": settings.automation}
        self._backlog: tuple[Any, int | None] = ((), None)  # (what it was read at, streams)

    def instance(self) -> Any:
        """Dagster's instance (DAGSTER_HOME), opened at the first reading; None without one."""
        if self._instance is None and self._dagster:
            from es_pipeline.health.dagster_state import open_instance
            self._instance = open_instance()
            self._dagster = self._instance is not None
        return self._instance

    def _snapshot_backlog(self, r: Reading) -> None:
        """Streams whose latest snapshot in the lake the store does not hold (the write-back's backlog), read
        again when the snapshots table or its newest materialization changed (a snapshots run does both), and
        every BACKLOG_EVERY seconds."""
        from es_pipeline.lake.state.snapshots import not_in_store_small
        from es_pipeline.store.event_store import EventStore

        table = self.lake.table("snapshots")
        key = (None if table is None else int(table.version()), (r.dagster.materialized if r.dagster else {}).get(
            "snapshots"), int(time.time() // BACKLOG_EVERY))
        if key != self._backlog[0]:
            missing = None if table is None else not_in_store_small(
                self.settings.warehouse, EventStore.for_source(self.settings.pg_dsn, self.source))
            self._backlog = (key, None if missing is None else missing.num_rows)
        r.snapshot_backlog = self._backlog[1]

    def reading(self, min_interval: float = MIN_INTERVAL) -> Reading:
        with self._lock:
            if self._last is not None and time.monotonic() - self._last.at < min_interval:
                return self._last
            self._last = self._take()
            self._last.at = time.monotonic()
            return self._last

    def _take(self) -> Reading:
        began = time.perf_counter()
        r = Reading()
        self._part(r, "store", lambda: setattr(r, "store", self.kept.run(
            lambda conn: read_store(conn, self.source, self.ranges))))

        def lake() -> None:
            r.events_version = self.lake.events_version()
            cursors = self.lake.cursors()
            r.behind = self.lake.behind(cursors=cursors)
            self.latency.observe(self.lake, r.events_version, cursors, {b.name: b.folded for b in r.behind})
            r.rebuilds = rebuild.progress(self.settings.warehouse)
            r.quarantined = dead_letters.counts(self.settings.warehouse)
            r.keyless = dead_letters.counts(self.settings.warehouse, keyless=True)
        self._part(r, "lake", lake)
        if self._dagster:
            def dagster() -> None:
                from es_pipeline.health.dagster_state import read_dagster
                if self.instance() is not None:
                    r.dagster = read_dagster(self._instance, ["events", *(b.name for b in r.behind), "snapshots"],
                                             declared=self.declared, ranges=[x.key for x in self.ranges])
            self._part(r, "dagster", dagster)
        self._part(r, "snapshots", lambda: self._snapshot_backlog(r))
        if self.settings.spark_remote:
            r.spark_connect = _answers(self.settings.spark_remote)
        r.seconds = time.perf_counter() - began
        return r

    @staticmethod
    def _part(r: Reading, name: str, read: Any) -> None:
        try:
            read()
            r.ok[name] = True
        except Exception as exc:  # noqa: BLE001 - one part down must not hide the others: it is a metric itself
            r.ok[name] = False
            r.errors[name] = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            log.warning("could not read %s: %s", name, r.errors[name])


def _answers(remote: str) -> tuple[str, bool]:
    """(host:port, whether it accepts a TCP connection) of a Spark Connect URL (`sc://host:port/;token=...`): the
    token is never part of what is shown."""
    parsed = urlparse(remote.split(";")[0].replace("sc://", "http://", 1))
    host, port = parsed.hostname or "localhost", parsed.port or 15002
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return f"{host}:{port}", True
    except OSError:
        return f"{host}:{port}", False


class PipelineCollector(Collector):
    """The metric families of one reading (prometheus_client calls `collect` on every scrape)."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader

    def collect(self) -> Iterator[Metric]:
        r = self.reader.reading()
        consumer = self.reader.source.consumer
        yield from _reading_metrics(r, consumer)
        if r.store is not None:
            yield from _store_metrics(r.store, consumer, self.reader.settings.tail_seconds)
        yield from lake_metrics(r, consumer, self.reader.latency, float(self.reader.settings.latency_bound_seconds))
        if r.snapshot_backlog is not None:
            yield _gauge("es_pipeline_snapshot_writeback_backlog", "Streams whose latest snapshot in the lake the "
                         "store does not hold (written back by the next snapshots run)", ["consumer"],
                         [([consumer], float(r.snapshot_backlog))])
        if r.dagster is not None:
            yield from dagster_metrics(r.dagster, consumer)
            yield _gauge("es_pipeline_sensor_interval_seconds", "The sensor's minimum interval between ticks",
                         ["sensor"], [([name], v) for name, v in sorted(self.reader.intervals.items())])
        if r.spark_connect is not None:
            g = GaugeMetricFamily("es_pipeline_spark_connect_up", "1 when the Spark Connect server accepts connections",
                                  labels=["endpoint"])
            g.add_metric([r.spark_connect[0]], 1.0 if r.spark_connect[1] else 0.0)
            yield g


def _gauge(name: str, doc: str, labels: list[str], rows: list[tuple[list[str], float]]) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in rows:
        g.add_metric(values, value)
    return g


def _reading_metrics(r: Reading, consumer: str) -> Iterator[Metric]:
    yield _gauge("es_pipeline_reading_ok", "1 when this part of the reading succeeded (store, lake, dagster)",
                 ["consumer", "part"], [([consumer, p], 1.0 if ok else 0.0) for p, ok in sorted(r.ok.items())])
    yield _gauge("es_pipeline_reading_seconds", "Wall-clock seconds the newest reading took", ["consumer"],
                 [([consumer], r.seconds)])


def _store_metrics(s: StoreReading, consumer: str, tail_seconds: int) -> Iterator[Metric]:
    now = s.taken_at
    yield _gauge("es_pipeline_horizon", "The store's horizon: pg_snapshot_xmin(pg_current_snapshot())",
                 ["consumer"], [([consumer], float(s.horizon))])
    held = GaugeMetricFamily(
        "es_pipeline_horizon_held_seconds",
        "Age of the oldest transaction with an id (what holds the horizon back), with who holds it; absent when none",
        labels=["consumer", "kind", "pid", "application_name", "user", "state"])
    h = s.holder
    if h is not None and h.seconds is not None:
        held.add_metric([consumer, h.kind, "" if h.pid is None else str(h.pid), h.application_name, h.user, h.state],
                        h.seconds)
    yield held
    yield _gauge("es_pipeline_events_waiting", "Committed events not yet in the lake, per range (counted up to "
                 "10,000): extractable now, or behind the horizon", ["consumer", "range", "state"],
                 [row for r in s.ranges for row in (([consumer, r.key, "extractable"], float(r.waiting.extractable)),
                                                    ([consumer, r.key, "behind_horizon"], float(r.waiting.behind_horizon)))])
    yield _gauge("es_pipeline_events_waiting_seconds", "Age of the oldest waiting event per range (by its recorded_at); "
                 "0 when none waits", ["consumer", "range", "state"],
                 [row for r in s.ranges for row in (
                     ([consumer, r.key, "extractable"], _age(now, r.waiting.oldest_extractable_at)),
                     ([consumer, r.key, "behind_horizon"], _age(now, r.waiting.oldest_behind_at)))])
    yield _gauge("es_pipeline_range_last_advance_timestamp_seconds", "When a watermark of the range last moved (a "
                 "pass that took events)", ["consumer", "range"],
                 [([consumer, r.key], float(r.last_advance)) for r in s.ranges if r.last_advance is not None])
    yield _gauge("es_pipeline_range_slices_locked", "Slices of the range a run holds the lock of (all of them while "
                 "a tailing run is alive)", ["consumer", "range"], [([consumer, r.key], float(r.slices_locked))
                                                                    for r in s.ranges])
    alive = bool(s.ranges) and all(r.slices_locked == r.slices for r in s.ranges)
    yield _gauge("es_pipeline_tailing_run_alive", "1 when a run holds every slice's lock (a tailing run alive)",
                 ["consumer"], [([consumer], 1.0 if alive else 0.0)])
    yield _gauge("es_pipeline_tailing_expected", "1 when the pipeline runs tailing runs (ES_PIPELINE_TAIL_SECONDS > 0)",
                 ["consumer"], [([consumer], 1.0 if tail_seconds > 0 else 0.0)])
    yield _gauge("es_pipeline_pending_batches", "Batches recorded before a lake write and not yet committed "
                 "(a crashed run's are replayed by the next)", ["consumer"], [([consumer], float(s.pending_batches))])
    yield _gauge("es_pipeline_source_ok", "0 when no run would extract: the store is not the one the offsets were "
                 "recorded on (a restore elsewhere), a standby, or the transaction ids went back", ["consumer"],
                 [([consumer], 0.0 if s.source_problem else 1.0)])
    yield _gauge("es_pipeline_source_problem", "Why the source is not ok, as a label (absent when it is)",
                 ["consumer", "problem"], [([consumer, s.source_problem], 1.0)] if s.source_problem else [])


def _age(now: float, at: float | None) -> float:
    return 0.0 if at is None else max(0.0, now - at)


def lake_metrics(r: Reading, consumer: str, latency: Latency,
                 bound: float = DEFAULT_LATENCY_BOUND_SECONDS) -> Iterator[Metric]:
    if r.events_version is not None:
        yield _gauge("es_pipeline_lake_events_version", "The Delta version of `events`", ["consumer"],
                     [([consumer], float(r.events_version))])
    yield _gauge("es_pipeline_projection_behind_versions", "`events` commits the projection has not folded",
                 ["consumer", "projection"], [([consumer, b.name], float(b.versions)) for b in r.behind])
    yield _gauge("es_pipeline_projection_behind_seconds", "Age of the oldest `events` commit the projection has not "
                 "folded; 0 when up to date", ["consumer", "projection"], [([consumer, b.name], b.seconds) for b in r.behind])
    # Every table the lake keeps, 0 where none is quarantined (an alert then resolves); the messages never here.
    held = {**{b.name: 0 for b in r.behind}, **r.quarantined}
    yield _gauge("es_pipeline_quarantined", "Streams (or cross-stream keys) quarantined in the table: a fold failed on "
                 "one of their events; their last good state is kept, their later events wait (`_dead_letters`, "
                 "`es-pipeline lake quarantined`)", ["consumer", "projection"],
                 [([consumer, name], float(n)) for name, n in sorted(held.items())])
    yield _gauge("es_pipeline_events_key_unreadable", "Events a cross-stream projection's key function failed on: "
                 "no key holds them (`_dead_letters`); a new revision of the projection folds them again",
                 ["consumer", "projection"], [([consumer, name], float(n)) for name, n in sorted(r.keyless.items())])
    yield _gauge("es_pipeline_rebuild_events_folded", "Events a rebuild beside stream_state has folded of those `events` "
                 "held when it started (lake/state/rebuild.py)", ["consumer", "stream_type"],
                 [([consumer, p.stream_type], float(p.events_folded)) for p in r.rebuilds])
    yield _gauge("es_pipeline_rebuild_events_total", "Events of the stream type `events` held when its rebuild started",
                 ["consumer", "stream_type"], [([consumer, p.stream_type], float(p.events_total)) for p in r.rebuilds])
    yield _gauge("es_pipeline_rebuild_expected_end_timestamp_seconds", "When the rebuild should have folded every piece, "
                 "at its pace so far", ["consumer", "stream_type"],
                 [([consumer, p.stream_type], p.expected_end.timestamp()) for p in r.rebuilds if p.expected_end])
    h = HistogramMetricFamily("es_pipeline_commit_to_lake_seconds", "Per `events` commit: from its oldest event's "
                              "recorded_at to the Delta commit", labels=["consumer"])
    h.add_metric([consumer], latency.events.buckets(), sum_value=latency.events.total)
    yield h
    t = HistogramMetricFamily("es_pipeline_commit_to_table_seconds", "Per `events` commit and table: from its oldest "
                              "event's recorded_at to the table's commit that holds it (`events`: the Delta commit; a "
                              "projection: the commit that folded it)", labels=["consumer", "table"])
    for name, histogram in [("events", latency.events), *sorted(latency.tables.items())]:
        t.add_metric([consumer, name], histogram.buckets(), sum_value=histogram.total)
    yield t
    yield _gauge("es_pipeline_latency_bound_seconds", "The commit→table p95 the EsPipelineTableLatencyHigh alert "
                 "holds each table to (ES_PIPELINE_LATENCY_BOUND_SECONDS)", ["consumer"], [([consumer], bound)])
    c = CounterMetricFamily("es_pipeline_lake_events_appended", "Events the `events` commits observed by this "
                            "exporter appended (its rate: throughput into the lake)", labels=["consumer"])
    c.add_metric([consumer], float(latency.rows))
    yield c


def dagster_metrics(d: Any, consumer: str) -> Iterator[Metric]:
    now = d.taken_at
    yield _gauge("es_pipeline_dagster_daemon_heartbeat_age_seconds", "Seconds since each Dagster daemon's newest "
                 "heartbeat", ["daemon"], [([kind], max(0.0, now - at)) for kind, at in sorted(d.heartbeats.items())])
    yield _gauge("es_pipeline_sensor_running", "1 when the sensor is on", ["sensor"],
                 [([t.sensor], 1.0 if t.running else 0.0) for t in d.ticks])
    yield _gauge("es_pipeline_sensor_tick_age_seconds", "Seconds since the sensor's newest tick", ["sensor"],
                 [([t.sensor], max(0.0, now - t.at)) for t in d.ticks if t.at is not None])
    yield _gauge("es_pipeline_sensor_tick_failed", "1 when the sensor's newest tick failed (the code server down, "
                 "an error)", ["sensor"], [([t.sensor], 1.0 if t.failed else 0.0) for t in d.ticks])
    yield _gauge("es_pipeline_range_last_pass_timestamp_seconds", "When the range's newest pass was reported (its "
                 "newest `events` materialization)", ["consumer", "range"],
                 [([consumer, k], p.at) for k, p in sorted(d.passes.items())])
    yield _gauge("es_pipeline_range_last_pass_events", "Events the range's newest report of passes brought",
                 ["consumer", "range"], [([consumer, k], float(p.events)) for k, p in sorted(d.passes.items())])
    yield _gauge("es_pipeline_range_pass_seconds", "Mean seconds of a pass in the range's newest report",
                 ["consumer", "range"], [([consumer, k], p.seconds) for k, p in sorted(d.passes.items())])
    yield _gauge("es_pipeline_tailing_runs_started", "Tailing runs Dagster has in progress", ["consumer"],
                 [([consumer], float(len(d.tailing_runs)))])
    # `dagster_job`, not `job`: Prometheus's own `job` label (the scrape job) would take its place.
    yield _gauge("es_pipeline_job_last_run_success", "1 when the job's newest finished run succeeded", ["dagster_job"],
                 [([r.job], 1.0 if r.status == "SUCCESS" else 0.0) for r in d.last_runs])
    yield _gauge("es_pipeline_job_last_run_timestamp_seconds", "When the job's newest finished run ended", ["dagster_job"],
                 [([r.job], r.at) for r in d.last_runs])
    # Not the error's text: a reducer's message may quote a payload, which has no place in the operators'
    # monitoring; the run (its id here) has it.
    yield _gauge("es_pipeline_asset_failing", "1 while the asset's newest run failed and it has not been materialized "
                 "since: that run, and the stream, version and event type a reducer or fold failed on",
                 ["asset", "dagster_job", "run_id", "stream_id", "version", "event_type"],
                 [([f.asset, f.job, f.run_id, f.failure.get("stream_id", ""), f.failure.get("version", ""),
                    f.failure.get("event_type", "")], 1.0) for f in d.failing])
    yield _gauge("es_pipeline_asset_last_materialization_timestamp_seconds", "When the asset was last materialized",
                 ["asset"], [([a], at) for a, at in sorted(d.materialized.items())])
    yield _gauge("es_pipeline_asset_freshness", "1 for the asset's freshness state (its FreshnessPolicy, evaluated by "
                 "Dagster's freshness daemon): PASS, WARN or FAIL", ["asset", "state"],
                 [([a, state], 1.0) for a, state in sorted(d.freshness.items())])
    yield _gauge("es_pipeline_asset_check_passed", "1 when the check's newest evaluation passed", ["asset", "check"],
                 [([a, c], 1.0 if ok else 0.0) for (a, c), ok in sorted(d.checks.items())])


def registry_for(reader: Reader) -> CollectorRegistry:
    """A registry with the pipeline's metrics and the exporter's own process (its CPU: what it costs)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PipelineCollector(reader))
    ProcessCollector(registry=registry)
    return registry


def serve(settings: Settings, *, host: str, port: int, stop: threading.Event) -> None:
    """Serve /metrics on host:port until `stop` is set."""
    from prometheus_client import start_http_server

    reader = Reader(settings)
    server, thread = start_http_server(port, addr=host, registry=registry_for(reader))
    log.info("es_pipeline metrics on http://%s:%d/metrics (pid %d)", host, port, os.getpid())
    try:
        stop.wait()
    finally:
        server.shutdown()
        thread.join(timeout=5)
