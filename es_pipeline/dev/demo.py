"""`make demo`: one headless pass — concurrent writers, extraction of every range, what an analyst sees."""

from __future__ import annotations

import time

from es_pipeline.dev import emmett_client
from es_pipeline.dev.workload import run_workload
from es_pipeline.errors import ConfigError, ForeignDemoTarget
from es_pipeline.extraction.extractor import extract_ranges
from es_pipeline.lake import cross_stream
from es_pipeline.lake.aggregates.builtin import update_event_type_daily, update_stream_catalog
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.read.catalog import register_tables
from es_pipeline.lake.spark import get_spark
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.lake.typed import event_tables
from es_pipeline.settings import Settings
from es_pipeline.store import tenants
from es_pipeline.store.adopt import adopt
from es_pipeline.store.conninfo import describe
from es_pipeline.store.event_store import EventStore
from es_pipeline.store.migrations import migrate

ANALYST_QUERY = """
SELECT event_date AS day, stream_type, event_type, count(*) AS events
FROM events GROUP BY event_date, stream_type, event_type
ORDER BY day, stream_type, events DESC
"""


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
DEMO_TENANTS = ("acme", "globex", "initech", "umbrella")  # the demo's tenants in a store partitioned by tenant


def demo_tenants(settings: Settings) -> tuple[str, ...]:
    """With `ES_PIPELINE_SOURCE=es-tenants`: the demo's tenants, each with its partition (made here); else none."""
    if not settings.source.native_tenants:
        return ()
    with EventStore(settings.pg_dsn, settings.schema).connect() as conn:
        conn.autocommit = True
        for tenant in DEMO_TENANTS:
            tenants.add(conn, settings.source, tenant)
    return DEMO_TENANTS


def ensure_local_target(settings: Settings) -> None:
    """`ForeignDemoTarget` unless the store is a database of the project's local server: demo events
    (and `make dev`'s writers) never go into a database somebody exported for real work."""
    host, port, dbname = describe(settings.pg_dsn)
    if host in LOCAL_HOSTS and port == str(settings.local_pg_port):
        return
    raise ForeignDemoTarget(f"{host}:{port}/{dbname}", f"127.0.0.1:{settings.local_pg_port}")


def _write_with_emmett(settings: Settings, events: int, writers: int) -> None:
    """Step 1 on an Emmett store: the real Emmett client appends from `writers` Node processes, then `source adopt`."""
    streams = 20
    per_stream = max(1, events // (writers * streams))
    print(f"1. writing {writers * streams * per_stream:,} events with Emmett's own client from {writers} Node processes "
          f"(npm ci into .cache/emmett on first use)")
    t0 = time.monotonic()
    procs = [emmett_client.start_appending(settings.pg_dsn, f"demo{int(time.time())}-{w}", streams, per_stream,
                                           per_append=1 + w % 4) for w in range(writers)]
    written = sum(emmett_client.finished(p) for p in procs)
    print(f"   appended {written:,} events to emt_messages in {time.monotonic() - t0:.1f} s")
    done = adopt(settings.pg_dsn, settings.source, echo=lambda _: None)
    print(f"   es-pipeline source adopt: {len(done.indexes)} index(es) built" if done.changed
          else "   es-pipeline source adopt: already adopted")


def run_demo_pass(settings: Settings, *, events: int = 50_000, writers: int = 8) -> None:
    ensure_local_target(settings)
    if settings.source.native:
        migrate(settings.pg_dsn, settings.schema, tenants=settings.source.native_tenants)
        store = EventStore(settings.pg_dsn, settings.schema)
        among = demo_tenants(settings)
        print(f"1. writing {events:,} demo events with {writers} concurrent writers (10% rollbacks, out-of-order commits)"
              + (f" for tenants {', '.join(among)}" if among else ""))
        report = run_workload(store, streams=max(100, events // 20), events=events, writers=writers,
                              rollback_rate=0.1, max_commit_delay=0.02, tenants=among)
        print("   " + report.summary())
    elif settings.source.name == "emmett":
        _write_with_emmett(settings, events, writers)
    else:
        raise ConfigError("ES_PIPELINE_SOURCE", settings.source_spec,
                          "es or emmett for the demo, which writes with their clients (other sources: docs/sources.md)")

    print(f"2. extracting {settings.slice_ranges} slice ranges into {EVENTS.path(settings.warehouse)}")
    t0 = time.monotonic()
    spark = get_spark(settings)
    print(f"   Spark up in {time.monotonic() - t0:.1f} s")
    print(f"   {'range':<10} {'events':>8} {'batches':>8} {'horizon':>10} {'behind H':>9} {'seconds':>8}")
    for res in extract_ranges(settings, None, lambda: spark, run_id="make-demo", progress=lambda m: None):
        print(f"   {res.range_key:<10} {res.rows:>8,} {res.batches:>8} {res.horizon:>10} {res.events_behind:>9,} {res.total_seconds:>8.1f}")

    t0 = time.monotonic()
    domain = settings.load_domain()
    engine = Engine(settings.engine, spark)
    state = update_stream_state(engine, settings.warehouse, domain=domain, store_dsn=settings.pg_dsn)
    print(f"   stream_state: folded {state.events_folded:,} events into {state.figures['streams_updated']:,} stream "
          f"states, built by {_by(state.engine)} ({time.monotonic() - t0:.1f} s)")
    for table, update in (("stream_catalog", update_stream_catalog), ("event_type_daily", update_event_type_daily)):
        t0 = time.monotonic()
        counted = update(engine, settings.warehouse, store_dsn=settings.pg_dsn)
        print(f"   {table}: {counted.events_folded:,} events counted into {counted.rows:,} rows, built by "
              f"{_by(counted.engine)} ({time.monotonic() - t0:.1f} s)")
    t0 = time.monotonic()
    typed = event_tables.update(settings.warehouse, domain, store_dsn=settings.pg_dsn, engine=engine)
    print(f"   typed event tables: {typed.events_folded:,} events into {typed.figures['tables_written']} tables, "
          f"built by {_by(typed.engine)} ({time.monotonic() - t0:.1f} s)")
    for name in sorted(domain.projections):  # the team's cross-stream projections
        t0 = time.monotonic()
        crossed = cross_stream.update(settings.warehouse, domain, name, store_dsn=settings.pg_dsn, engine=engine)
        print(f"   {name}: {crossed.events_folded:,} events folded into {crossed.rows:,} keys, built by "
              f"{_by(crossed.engine)} ({time.monotonic() - t0:.1f} s)")

    register_tables(spark, settings.warehouse)
    total = spark.sql("SELECT count(*) AS n, count(DISTINCT stream_id) AS streams FROM events").first()
    print(f"3. the lake holds {total['n']:,} events of {total['streams']:,} streams")
    if settings.source.tenant != "''":
        print("   per tenant:")
        spark.sql("SELECT tenant, count(*) AS events, count(DISTINCT stream_id) AS streams FROM events "
                  "GROUP BY tenant ORDER BY tenant").show(20, truncate=False)
    print("   events per type per day:")
    print("   " + ANALYST_QUERY.strip().replace("\n", "\n   "))
    spark.sql(ANALYST_QUERY).show(20, truncate=False)

    print("   a few rows of stream_state:")
    spark.sql(
        "SELECT stream_id, stream_type, version, state, last_event_at FROM stream_state ORDER BY version DESC LIMIT 5"
    ).show(5, truncate=80)
    print("   event_type_daily:")
    spark.sql("SELECT * FROM event_type_daily ORDER BY event_date, stream_type, events DESC").show(10, truncate=False)


def _by(engine: str) -> str:
    return "Spark" if engine == "spark" else "this process"
