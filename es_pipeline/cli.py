"""The `es-pipeline` command line: argparse only; each command calls one library function."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from es_pipeline.errors import EsPipelineError, SliceLocked, explain
from es_pipeline.settings import Settings

if TYPE_CHECKING:
    from es_pipeline.domain import Domain
    from es_pipeline.lake.kernel.engine import Engine

# Each command imports what it runs when it runs: `es-pipeline sql` answers without loading pandas, Spark or
# Dagster's neighbours (an import of everything took 1.5 s before the first row).
ENGINES = ("duckdb", "spark")  # lake/read/query.py
FORMATS = ("table", "csv", "json")


def _db(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.dev import local_server
    from es_pipeline.store import roles
    from es_pipeline.store.migrations import migrate

    if args.action == "start":
        state = local_server.start(settings.local_pg_port)
        print(f"local PostgreSQL {state} on 127.0.0.1:{settings.local_pg_port} (data in {local_server.PGDATA})")
    elif args.action == "dsn":  # names the passfile, never a password
        from es_pipeline.settings import local_pg_dsn

        print(local_pg_dsn(settings.local_pg_port))
    elif args.action == "stop":
        print("local PostgreSQL stopped" if local_server.stop() else "local PostgreSQL was not running")
    elif args.action == "roles":
        n = roles.apply(settings.pg_dsn, settings.schema)
        print(f"-- {n} statements applied: roles {', '.join(roles.ROLES)} (docs/security.md)")
    elif args.action == "migrate":
        applied = migrate(settings.pg_dsn, settings.schema, tenants=settings.source.native_tenants)
        if applied:
            for m in applied:
                print(f"applied migration {m.version}: {m.name}")
        else:
            print(f"schema {settings.schema!r} is up to date")
    return 0


def _source(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.source.mapping import describe
    from es_pipeline.store.adopt import adopt

    source = settings.source
    if args.action == "show":
        print(f"source {source.label}; the lake's columns, from the table's (alias t):")
        for line in describe(source):
            print(f"  {line}")
        return 0
    if source.native:
        print("the native store (es.events) is prepared by `es-pipeline db migrate`; nothing to adopt")
        return 0
    done = adopt(settings.pg_dsn, source, echo=lambda statement: print(f"-- {statement}", flush=True))
    if done.changed:
        print(f"adopted {source.label}: added {', '.join(done.added) or 'no column'}; "
              f"built {len(done.indexes)} index(es)")
    else:
        print(f"{source.label} was already adopted: nothing changed")
    return 0


def _tenant(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.extraction.erase import erase_tenant
    from es_pipeline.store import tenants
    from es_pipeline.store.event_store import EventStore

    source = settings.source
    if args.action == "add":
        with EventStore(settings.pg_dsn, settings.schema).connect() as conn:
            conn.autocommit = True
            part, created = tenants.add(conn, source, args.tenant)
            tenants.forget_erasure(conn, source.consumer, args.tenant)
        print(f"tenant {args.tenant!r}: partition {part.qualified} " + ("created" if created else "exists already"))
        return 0
    if not args.yes:
        print(f"this removes tenant {args.tenant!r} from {source.label}, from every lake table and from the "
              "snapshots, and purges the files: it cannot be undone. Run again with --yes to do it.", file=sys.stderr)
        return 2
    done = erase_tenant(settings, args.tenant, wait_seconds=args.wait, progress=lambda m: print(m, flush=True))
    print(f"erased tenant {args.tenant!r}: " + (f"dropped {done.partition} ({done.store_events:,} events)"
                                                if done.partition else "no partition left in the store"))
    rows = {**{(t if "." in t else f"{settings.source.schema}.{t}") + " (store)": n for t, n in done.store_rows.items()},
            **{f"{t} (lake)": n for t, n in done.lake_rows.items()}}
    for table, n in rows.items():
        print(f"  {table:<26} {n:>10,} rows deleted")
    print(f"  {done.files_purged:,} files purged; no Parquet file of the lake holds the tenant")
    if done.rebuilt:
        print(f"  {', '.join(done.rebuilt)} lagged behind events: the next update rebuilds them whole")
    return 0


def _demo_load(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.dev.demo import demo_tenants, ensure_local_target
    from es_pipeline.dev.workload import run_workload
    from es_pipeline.store.event_store import EventStore

    ensure_local_target(settings)
    if args.check:
        print(f"demo target: the local server's database ({settings.pg_dsn.rsplit('/', 1)[-1]})")
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    store = EventStore(settings.pg_dsn, settings.schema)
    if args.forever:
        print(f"writing about {args.rate:g} events/s with {args.writers} writers until stopped (Ctrl-C)", flush=True)
    try:
        report = run_workload(
            store,
            streams=args.streams,
            events=None if args.forever else args.events,
            writers=args.writers,
            rollback_rate=args.rollback_rate,
            max_commit_delay=args.max_commit_delay,
            seed=args.seed,
            rate=args.rate if args.forever else None,
            stop=stop,
            tenants=demo_tenants(settings),
        )
    except KeyboardInterrupt:
        stop.set()
        return 130
    print(report.summary())
    return 0


def _extract(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.extraction.extractor import extract_ranges
    from es_pipeline.lake.events import EVENTS
    from es_pipeline.lake.spark import get_spark

    total = 0
    for res in extract_ranges(settings, args.range, lambda: get_spark(settings),
                              run_id=f"cli-{int(time.time())}", progress=functools.partial(print, flush=True)):
        total += res.rows
        jdbc = f" ({res.jdbc_batches} read by Spark's executors over JDBC)" if res.jdbc_batches else ""
        print(f"{res.range_key}: {res.rows:,} events in {res.batches} batches{jdbc}, horizon {res.horizon}, "
              f"{res.events_behind:,} behind the horizon ({res.total_seconds:.1f} s)", flush=True)
    print(f"extracted {total:,} events into {EVENTS.path(settings.warehouse)}")
    return 0


def _offsets(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.extraction import offsets
    from es_pipeline.extraction.rebase import rebase
    from es_pipeline.lake.events import EVENTS
    from es_pipeline.store.conninfo import connect

    events_path = EVENTS.path(settings.warehouse)
    args.consumer = args.consumer or settings.source.consumer
    if args.action == "rebase":
        done = rebase(settings.pg_dsn, settings.source, args.consumer, events_path)
        if done is None:
            print(f"nothing to rebase: the offsets of consumer {args.consumer!r} count this cluster's transaction ids")
        else:
            held = (f"all {done.lake_events:,} events of the lake are in the store" if not done.deleted else
                    f"the {done.lake_events - done.deleted:,} events of the lake that the store still holds are in it "
                    f"({done.deleted:,} more its framework has deleted since: they cannot be checked)")
            print(f"rebased consumer {args.consumer!r} onto cluster {done.cluster}: {held}; forgot {done.forgotten_slices} slice watermarks. The next runs read the "
                  f"store again and leave out, by key, the events the lake holds (below transaction {done.rebased_below}).")
        return 0
    try:
        n = offsets.reset_consumer(settings.pg_dsn, args.consumer, events_path, lake_removed=args.lake_removed)
    except SliceLocked as exc:
        print(f"es-pipeline offsets reset: refused, nothing was forgotten: {exc.holder} is extracting slices of "
              f"consumer {args.consumer!r}. Let the running events runs finish (turn new_events_sensor off to stop "
              "new ones), then run this again.", file=sys.stderr)
        return 1
    print(f"forgot {n} slice watermarks of consumer {args.consumer!r}; the next runs extract from the beginning")
    with connect(settings.pg_dsn, autocommit=True) as conn:
        foreign = offsets.events_from_another_cluster(conn, settings.source, args.consumer)
    if foreign:  # never silent: the rows the horizon would hide (docs/operations.md, "A store with a past")
        print(f"the store holds {foreign:,} events whose transaction ids this cluster has not assigned yet (written by "
              "another cluster): the next run rebases by itself, the lake being empty, and takes them once each")
    return 0


def _lake(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.extraction.rebuild import EVENTS, rebuild, rebuildable

    if args.action == "rebuilds":
        return _rebuilds(args, settings)
    if args.action == "check":
        return _check(args, settings)
    if args.action == "quarantined":
        return _quarantined(args, settings)
    if args.action == "retry":
        return _retry(args, settings)
    names = list(dict.fromkeys(args.tables or [EVENTS]))
    if args.list:
        print("\n".join(rebuildable(settings.warehouse)))
        return 0
    try:
        rebuild(settings.pg_dsn, settings.source, settings.warehouse, names, accept_loss=args.accept_loss)
    except SliceLocked as exc:
        print(f"es-pipeline lake rebuild: refused, nothing was changed: {exc.holder} is extracting slices of "
              f"consumer {settings.source.consumer!r}. Let the running events runs finish (turn new_events_sensor off "
              "to stop new ones), then run this again.", file=sys.stderr)
        return 1
    return 0


def _domain(settings: Settings) -> Domain:
    """The team's domain (ES_PIPELINE_DOMAIN, or the attribute that set it)."""

    return settings.load_domain()


def _engine(args: argparse.Namespace, settings: Settings) -> Engine:
    """Where a lake command's work runs: `--engine`, else ES_PIPELINE_ENGINE; a local Spark started only if needed."""
    from es_pipeline.lake.kernel.engine import Engine
    from es_pipeline.lake.spark import get_spark

    return Engine(args.engine or settings.engine, lambda: get_spark(settings))


def _check(args: argparse.Namespace, settings: Settings) -> int:
    """`lake check`: the library's checks of the named tables (every table's by default), one line each as it ends;
    1 when one fails or cannot run, 2 for a table no check knows."""
    from es_pipeline import checks

    try:
        chosen = checks.select(checks.every_check(_domain(settings)), args.tables)
    except ValueError as exc:
        print(f"es-pipeline lake check: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for check in chosen:
            print(f"{check.table:<20} {check.name:<40} {check.description}")
        return 0
    from es_pipeline.lake.read.metastore import Metastore

    given = checks.Given(_engine(args, settings), settings.warehouse, settings.pg_dsn, settings.source,
                         metastore=Metastore.of(settings))
    print(f"checking {len(chosen)} check(s) of {settings.warehouse} against {settings.source.label}", flush=True)

    def said(check: checks.Check, outcome: checks.Outcome | Exception, seconds: float) -> None:
        if isinstance(outcome, Exception):
            line = f"ERROR {check.name} ({check.table}): {type(outcome).__name__}: {outcome}"
        else:
            line = f"{'PASS ' if outcome.passed else 'FAIL '} {check.name} ({check.table}): {outcome.line()}"
        print(f"{line} [{seconds:.1f} s]", flush=True)

    found = checks.run(chosen, given, say=said)
    failed = [name for name, o in found.items() if isinstance(o, Exception) or not o.passed]
    print(f"{len(found) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _quarantined(args: argparse.Namespace, settings: Settings) -> int:
    """`lake quarantined [TABLE...]`: the streams (or cross-stream keys) a fold holds at their last good state, one
    line each, from `_dead_letters`; exit 0 (a list, not a check: the alert and `lake check` say what fails)."""
    from es_pipeline.lake.kernel import dead_letters

    rows = dead_letters.rows_of(settings.warehouse).to_pylist()
    if args.tables:
        rows = [r for r in rows if r["table_name"] in args.tables]
    if not rows:
        print(f"nothing quarantined{' in ' + ', '.join(args.tables) if args.tables else ''} "
              f"(ES_PIPELINE_FOLD_ERRORS={settings.fold_errors})")
        return 0
    print(f"{len(rows)} quarantined (held at their last good state; their later events wait):")
    for r in rows:
        tenant = f" tenant {r['tenant']!r}" if r["tenant"] else ""
        since = r["first_seen"].isoformat(timespec="seconds") if r["first_seen"] else "?"
        print(f"  {r['table_name']}{tenant} {r['key']!r} ({r['stream_type'] or '-'}) at version {r['version']} "
              f"({r['event_type']}): {r['error_kind']}: {r['message']} [since {since}, {r['retries']} retries]")
    print("A fix deployed as a new reducer revision refolds them; every update retries them with the code deployed "
          "(docs/operations.md, \"EsPipelineStreamsQuarantined\").")
    return 0


def _retry(args: argparse.Namespace, settings: Settings) -> int:
    """`lake retry [TABLE...] [--stream ID...]`: the quarantined streams (or keys) of `stream_state` and the domain's
    cross-stream projections (default: every one) refolded now with the code deployed (an update where the table is
    behind `events`: it refolds every one); what is left quarantined; exit 1 if any, 2 for an unknown table."""
    import pyarrow.compute as pc

    from es_pipeline.extraction.offsets import batch_frontier
    from es_pipeline.lake import cross_stream
    from es_pipeline.lake.kernel import dead_letters
    from es_pipeline.lake.state.stream_state import retry, update_stream_state

    domain = _domain(settings)
    known = ["stream_state", *sorted(domain.projections)]
    unknown = [t for t in args.tables if t not in known]
    if unknown:
        print(f"es-pipeline lake retry: {', '.join(unknown)}: not a table whose rows can be quarantined here; these "
              f"are: {', '.join(known)}", file=sys.stderr)
        return 2
    chosen = args.tables or (["stream_state"] if args.stream else known)
    if args.stream and chosen != ["stream_state"]:
        print("es-pipeline lake retry: --stream names streams of stream_state only", file=sys.stderr)
        return 2
    before = dead_letters.counts(settings.warehouse)
    consumer = settings.source.consumer
    for name in chosen:
        if name == "stream_state":
            done = retry(settings.warehouse, domain, store_dsn=settings.pg_dsn, streams=args.stream or ())
            if done is None:
                print("stream_state is behind events (or not built): an update folds the new events and retries "
                      "every quarantined stream", flush=True)
                update_stream_state(_engine(args, settings), settings.warehouse, domain=domain,
                                    store_dsn=settings.pg_dsn)
            continue
        frontier = lambda: batch_frontier(settings.pg_dsn, consumer)  # noqa: E731 - the store's, as every update's
        if cross_stream.retry(settings.warehouse, domain, name, store_dsn=settings.pg_dsn, frontier=frontier) is None:
            print(f"{name} is behind events (or not built): an update folds the new events and retries every held "
                  "key", flush=True)
            cross_stream.update(settings.warehouse, domain, name, store_dsn=settings.pg_dsn, frontier=frontier,
                                engine=_engine(args, settings))
    left = 0
    for name in chosen:
        rows = dead_letters.rows_of(settings.warehouse, name)
        held = rows.filter(pc.is_valid(rows["key"]))
        left += held.num_rows
        print(f"quarantined in {name}: {before.get(name, 0)} listed before, {held.num_rows} held now"
              + (f" ({rows.num_rows - held.num_rows} events whose key could not be read stay listed)"
                 if rows.num_rows > held.num_rows else ""))
        for r in held.to_pylist():
            print(f"  {r['key']!r} at {r['stream_id']!r} version {r['version']} ({r['event_type']}): {r['error_kind']} "
                  f"[{r['retries']} retries]")
    return 1 if left else 0


def _rebuilds(args: argparse.Namespace, settings: Settings) -> int:
    """`lake rebuilds`: the stream types to rebuild and how far each rebuild beside `stream_state` is; `--run`: run
    them now, here (the engine rule, or `--engine`), each swapped in when caught up."""
    from es_pipeline.lake.kernel.turn import one_at_a_time
    from es_pipeline.lake.state import rebuild

    domain = _domain(settings)
    if args.run:
        swapped = rebuild.run_pending(_engine(args, settings), settings.warehouse, domain, settings.pg_dsn, say=print)
        print(f"swapped into stream_state: {', '.join(swapped) or 'none'}")
    with one_at_a_time(settings.pg_dsn, "stream_state"):
        waiting = rebuild.pending_now(settings.warehouse, domain)
    under_way = {p.stream_type: p for p in rebuild.progress(settings.warehouse)}
    held = " (held: ES_PIPELINE_REBUILDS=hold)" if settings.rebuilds == "hold" else ""
    print(f"stream types to rebuild: {', '.join(waiting) or 'none'}{held if waiting else ''}")
    for stream_type in waiting:
        found = under_way.get(stream_type)
        print(f"  {found.line() if found else f'{stream_type}: not started (its old rows in service)'}")
    return 0


def _status(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.health.exporter import Reader

    reader = Reader(settings, dagster=not args.no_dagster)
    if args.watch:
        from es_pipeline.health.watch import watch

        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            watch(reader, interval=args.interval, stop=stop)
        except KeyboardInterrupt:
            pass
        return 0
    from es_pipeline.extraction.status import status_report
    from es_pipeline.health.watch import health_line

    conf = args.configuration
    if conf.component:
        print(f"settings: component {conf.component} and the environment (`es-pipeline config` shows each)")
    print(status_report(settings))
    print(health_line(reader.reading(), tailing=settings.tail_seconds > 0, intervals=reader.intervals))
    if settings.domain_modules:  # a domain that does not import stops every projection: said here, not only in a run

        try:
            domain = settings.load_domain()
        except EsPipelineError as exc:
            print(f"domain: {exc}")
            return 1
        from es_pipeline.lake.state import rebuild

        waiting = rebuild.waiting(settings.warehouse, domain)
        if waiting:
            print(f"stream_state: not up to date for {', '.join(waiting)}: {_REBUILD_WAITS}")
    return 0


def _metrics(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.health import exporter

    if args.once:
        from prometheus_client import generate_latest

        sys.stdout.write(generate_latest(exporter.registry_for(exporter.Reader(settings))).decode())
        return 0
    if args.rules:
        sys.stdout.write(exporter.ALERTS.read_text())
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"es_pipeline metrics: http://{args.host}:{args.port}/metrics (Ctrl-C stops)", flush=True)
    try:
        exporter.serve(settings, host=args.host, port=args.port, stop=stop)
    except KeyboardInterrupt:
        pass
    return 0


def _sql(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.lake.read import query

    first = args.limit if args.format == "table" else None  # a terminal's rows only: never the whole of `events`
    answer = query.run(settings.warehouse, args.query, engine=args.engine, settings=settings, first=first)
    if not answer.tables:
        print(f"no Delta tables under {settings.warehouse} yet: run `make demo` or materialize `events` first",
              file=sys.stderr)
    query.write(answer.rows, args.format, limit=args.limit, complete=answer.complete)
    return 0


def _catalog(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.lake.read import metastore

    if args.action == "sync":
        done = metastore.sync(settings, say=lambda line: print(line, flush=True))
        how = "Spark registered the difference" if done.jvm else "nothing to change, no JVM started"
        print(f"catalog: {done.tables} tables in `{done.schema}`, {len(done.registered)} registered, "
              f"{len(done.dropped)} dropped ({how}; {done.seconds:.1f} s)")
        return 0
    ms = metastore.Metastore.required(settings)
    catalog = metastore.registered(ms)
    for name in sorted(catalog):
        print(f"{ms.schema}.{name}\t{catalog[name]}")
    diff = metastore.difference(ms, settings.warehouse)
    print(f"catalog: {len(catalog)} tables in `{ms.schema}`; against the lake: {diff.describe()}"
          + (" (`es-pipeline catalog sync` registers the difference)" if diff else ""))
    return 1 if diff else 0


def _sql_endpoint(args: argparse.Namespace, settings: Settings) -> int:
    import getpass

    from es_pipeline.lake.read import endpoint

    if args.add_user:
        password = os.environ.get("ES_PIPELINE_NEW_USER_PASSWORD") or getpass.getpass(f"password for {args.add_user}: ")
        where = endpoint.add_user(args.add_user, password)
        print(f"SQL endpoint: user {args.add_user} added to {where} (a salted hash; used with "
              "ES_PIPELINE_SQL_ENDPOINT_AUTH=password)")
        return 0
    return endpoint.serve(settings, host=args.host, port=args.port, say=lambda line: print(line, flush=True))


def _spark(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.dev.connect_token import TOKEN_ENV, TOKEN_FILE, local_remote, local_token
    from es_pipeline.lake.spark import connect_server_command, delta_jars, prepare_local_start
    from es_pipeline.settings import PROJECT_ROOT

    if args.action == "jars":
        for jar in delta_jars():
            print(jar)
        return 0
    cmd = connect_server_command(settings, port=args.port)
    prepare_local_start()
    # The server requires this token of every client (Spark reads it from the environment, not the command line).
    source = f"${TOKEN_ENV}" if os.environ.get(TOKEN_ENV) else str(TOKEN_FILE.relative_to(PROJECT_ROOT))
    os.environ.setdefault(TOKEN_ENV, local_token())
    print(f"Spark Connect server with Delta on {local_remote(args.port)} (master {settings.spark_master}); "
          f"clients need the token in {TOKEN_ENV} (this server's: {source})", flush=True)
    os.execvp(cmd[0], cmd)  # replaces this process: Ctrl-C and SIGTERM reach the server directly
    return 0


def _config(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.project import partition_keys
    from es_pipeline.settings import DECLARED, PROJECT_ROOT, markdown_table, shown
    from es_pipeline.store.conninfo import describe

    if args.markdown:
        print(markdown_table(), end="")
        return 0
    conf = args.configuration
    print(f"project: {conf.project or PROJECT_ROOT}" + (f" (component {conf.component})" if conf.component else ""))
    if conf.note:
        print(f"note: {conf.note}")
    host, port, dbname = describe(settings.pg_dsn)
    for setting in DECLARED:
        value = (f"{host}:{port}/{dbname} (the DSN itself is never shown)" if setting.field == "pg_dsn"
                 else shown(setting, settings))
        print(f"  {setting.variable:<34} {value:<48} from {conf.source_of(setting.variable)}")
    print(f"  partitions of `events`: {', '.join(partition_keys(settings))}")
    return 0


def _doctor(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.health.doctor import FAIL, diagnose

    conf = args.configuration
    print(f"settings: {('component ' + conf.component + ' and ') if conf.component else ''}the environment "
          "(`es-pipeline config` shows each)")
    failed = 0
    for finding in diagnose(settings):
        print(f"{finding.level:<5} {finding.what:<11} {finding.line}")
        failed += finding.level == FAIL
    return 1 if failed else 0


def _materialize(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.project import dagster_home, materialize, partition_keys, rebuilds_waiting

    if args.list:
        print("\n".join(partition_keys(settings)))
        return 0
    print(f"materializing into {settings.warehouse}, recorded in the Dagster instance at {dagster_home(settings)}",
          flush=True)

    def said(done) -> None:
        figures = ", ".join(f"{k} {v}" for k, v in done.metadata.items()
                            if k in ("rows", "events", "events_folded", "streams_updated", "quarantined_streams",
                                     "batches") and v is not None)
        print(f"  {done.asset}{' ' + done.partition if done.partition else ''}: {figures or 'done'} "
              f"({done.seconds:.1f} s)", flush=True)

    materialize(settings, progress=said)
    from es_pipeline.lake.kernel import dead_letters

    held = {t: n for t, n in dead_letters.counts(settings.warehouse).items() if n}
    if held:  # never "up to date" while a stream is held behind its events
        print(f"the lake is up to date but for {', '.join(f'{n} quarantined in {t}' for t, n in sorted(held.items()))}"
              ": a reducer failed on their events (`es-pipeline lake quarantined`; docs/domain.md, \"When a reducer "
              "fails\")")
    waiting = rebuilds_waiting(settings)
    if waiting:  # ES_PIPELINE_REBUILDS=hold, or a rebuild that could not finish: never "up to date" then
        print(f"the lake is up to date but for stream_state's {', '.join(waiting)}: {_REBUILD_WAITS}")
    if held or waiting:
        return 0
    print("the lake is up to date: `es-pipeline sql \"SELECT * FROM stream_state LIMIT 5\"`")
    return 0


_REBUILD_WAITS = ("waiting for its rebuild beside stream_state (its old rows, or none, in service); "
                  "`es-pipeline lake rebuilds --run` builds it now (ES_PIPELINE_REBUILDS=hold keeps it waiting)")


def _dagster_yaml(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.health.doctor import recommended_instance_yaml

    print(recommended_instance_yaml(), end="")
    return 0


def _demo_run(args: argparse.Namespace, settings: Settings) -> int:
    from es_pipeline.dev.demo import run_demo_pass

    run_demo_pass(settings, events=args.events, writers=args.writers)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="es-pipeline", description=__doc__)
    p.add_argument("--component", help="in a dg project with several EsPipeline components: the folder of the one to "
                   "read (its defs.yaml's attributes are the settings, as in the code location)")
    sub = p.add_subparsers(dest="command", required=True)

    cf = sub.add_parser("config", help="every setting, and where it came from (a dg project's component, the "
                        "environment, the default); the partition keys")
    cf.add_argument("--markdown", action="store_true",
                    help="print the README's table of settings, made from their declarations (es_pipeline/settings.py)")
    cf.set_defaults(func=_config)
    dr = sub.add_parser("doctor", help="check the domain, the store and its migrations, the lake, Java and the jars, "
                        "the Dagster instance: one line each; exit 1 when something fails")
    dr.set_defaults(func=_doctor)
    ma = sub.add_parser("materialize", help="bring the lake up to date now, in this process, recorded in Dagster: "
                        "`events` range by range, then every projection (the first run of a new lake)")
    ma.add_argument("--list", action="store_true", help="print the partition keys of `events` and do nothing")
    ma.set_defaults(func=_materialize)
    dy = sub.add_parser("dagster-yaml", help="print the Dagster instance settings es_pipeline relies on "
                        "(for $DAGSTER_HOME/dagster.yaml in a dg project)")
    dy.set_defaults(func=_dagster_yaml)

    db = sub.add_parser("db", help="the local PostgreSQL server and the event-store migrations")
    db.add_argument("action", choices=["start", "stop", "migrate", "roles", "dsn"],
                    help="roles: create es_pipeline's group roles and their grants (idempotent; prints the SQL); "
                    "dsn: the local server's connection string (it names the passfile, never the password)")
    db.set_defaults(func=_db)

    demo = sub.add_parser("demo", help="demo workloads")
    dsub = demo.add_subparsers(dest="demo_command", required=True)
    load = dsub.add_parser("load", help="append demo events from concurrent writers")
    load.add_argument("--streams", type=int, default=1000, help="streams to create (default 1000)")
    load.add_argument("--events", type=int, default=10_000, help="events to commit (default 10000)")
    load.add_argument("--writers", type=int, default=8, help="concurrent writers, each with its own connection")
    load.add_argument("--rollback-rate", type=float, default=0.1, help="fraction of transactions rolled back")
    load.add_argument("--max-commit-delay", type=float, default=0.05,
                      help="hold each transaction open up to this many seconds (out-of-order commits)")
    load.add_argument("--seed", type=int, default=42)
    load.add_argument("--forever", action="store_true", help="keep writing until stopped, at --rate")
    load.add_argument("--rate", type=float, default=50.0, help="events/s with --forever (default 50)")
    load.add_argument("--check", action="store_true", help="only check that the store is the local server's")
    load.set_defaults(func=_demo_load)
    run = dsub.add_parser("run", help="one headless end-to-end pass: load, extract, project, query")
    run.add_argument("--events", type=int, default=50_000)
    run.add_argument("--writers", type=int, default=8)
    run.set_defaults(func=_demo_run)

    ex = sub.add_parser("extract", help="extract slice ranges into the Delta events table, without Dagster")
    ex.add_argument("--range", action="append", help="a range key like 0000-0127 (repeatable; default: all)")
    ex.set_defaults(func=_extract)

    off = sub.add_parser("offsets", help="the per-slice watermarks")
    off.add_argument("action", choices=["reset", "rebase"],
                     help="reset: forget them (to rebuild a lost lake from scratch); rebase: after the store moved "
                     "to another cluster (a restore, a cut-over), bring every event the lake lacks into it exactly once")
    off.add_argument("--consumer", help="default: the store's own (`events`, or `events:<schema>` for another schema)")
    off.add_argument("--lake-removed", action="store_true",
                     help="the lake's events table is gone, though it cannot be checked from here")
    off.set_defaults(func=_offsets)

    lake = sub.add_parser("lake", help="the lake's tables (docs/operations.md, \"Rebuilding the lake\")")
    lake.add_argument("action", choices=["check", "quarantined", "rebuild", "rebuilds", "retry"],
                      help="check: run the checks of the named tables (default: every table), each against what it "
                      "is built from, one line each; exit 1 when one fails (docs/operations.md, \"Checking the lake\"). "
                      "rebuild: build tables again from their source. `events` (the default) from the store: "
                      "refused while a run extracts or where the lake holds events the store lacks; then removed and "
                      "the offsets reset, and every projection rebuilds itself at its next update. A projection: "
                      "removed in its turn; its next update builds it whole from `events`. rebuilds: the stream "
                      "types whose reducer changed, rebuilt beside stream_state, and how far each is (--run: now). "
                      "quarantined: the streams (or keys) a fold failed on, held at their last good state "
                      "(`_dead_letters`). retry: refold them now with the code deployed (stream_state and every "
                      "cross-stream projection, or those named; --stream: those streams of stream_state alone); exit 1 "
                      "while any is held")
    lake.add_argument("tables", nargs="*", help="events (rebuild's default) and/or projections; --list names them")
    lake.add_argument("--list", action="store_true", help="the tables this lake can rebuild (check: the checks), "
                      "and do nothing")
    lake.add_argument("--accept-loss", action="store_true",
                      help="rebuild events even where the lake holds events the store lacks: they are lost")
    lake.add_argument("--run", action="store_true", help="rebuilds: run the pending rebuilds now, in this process")
    lake.add_argument("--stream", action="append", metavar="ID", help="retry: this quarantined stream (repeatable)")
    lake.add_argument("--engine", choices=["auto", "spark", "local"],
                      help="check, rebuilds --run, retry: where the work runs (default: ES_PIPELINE_ENGINE)")
    lake.set_defaults(func=_lake)

    src = sub.add_parser("source", help="the event table read (ES_PIPELINE_SOURCE, docs/sources.md)")
    src.add_argument("action", choices=["adopt", "show"],
                     help="adopt: prepare an existing store (tx_id column, indexes built CONCURRENTLY; idempotent); "
                     "show: how the table's columns become the lake's")
    src.set_defaults(func=_source)

    ten = sub.add_parser("tenant", help="tenants of a store partitioned by tenant (docs/sources.md, \"Tenants\")")
    ten.add_argument("action", choices=["add", "erase"],
                     help="add: create the tenant's partition (ES_PIPELINE_SOURCE=es-tenants); erase: remove the tenant "
                     "from the store (drop its partition), the lake, every projection and the snapshots, and purge the files")
    ten.add_argument("tenant")
    ten.add_argument("--yes", action="store_true", help="erase: confirm (it cannot be undone)")
    ten.add_argument("--wait", type=float, default=600.0,
                     help="erase: seconds to wait for running `events` runs to release their slices (default 600)")
    ten.set_defaults(func=_tenant)

    st = sub.add_parser("status", help="per range: watermark, horizon, lag, oldest open transaction; then one line of "
                        "health (the tailing run, the daemon, the sensor, Spark Connect)")
    st.add_argument("--watch", action="store_true", help="a live view, refreshed in place (Ctrl-C stops)")
    st.add_argument("--interval", type=float, default=2.0, help="--watch: seconds between refreshes (default 2)")
    st.add_argument("--no-dagster", action="store_true", help="leave Dagster's instance out (store and lake only)")
    st.set_defaults(func=_status)

    me = sub.add_parser("metrics", help="serve the pipeline's health to Prometheus (docs/operations.md)")
    me.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    me.add_argument("--port", type=int, default=9464, help="port (default 9464)")
    me.add_argument("--once", action="store_true", help="print one scrape to stdout and exit")
    me.add_argument("--rules", action="store_true", help="print the Prometheus alert rules (alerts.yml) and exit")
    me.set_defaults(func=_metrics)

    q = sub.add_parser("sql", help="SQL over the lake, every table by its name: DuckDB (no JVM) or Spark SQL")
    q.add_argument("query")
    q.add_argument("--engine", choices=ENGINES, default="duckdb",
                   help="duckdb (default: an answer in well under a second) or spark (time travel, DESCRIBE HISTORY)")
    q.add_argument("--format", choices=FORMATS, default="table",
                   help="table (for a terminal), csv or json (one object per line); csv and json print every row")
    q.add_argument("--limit", type=int, default=50, help="table: rows shown (default 50)")
    q.add_argument("--truncate", action="store_true", help=argparse.SUPPRESS)  # before 0.2: cells are always cut
    q.set_defaults(func=_sql)

    ca = sub.add_parser("catalog", help="the lake's tables by name in the Hive metastore (docs/analysts.md)")
    ca.add_argument("action", choices=["sync", "show"],
                    help="sync: register the lake's tables the catalog lacks, drop those gone (Spark only if any); "
                    "show: the catalog's tables and the difference with the lake (exit 1 if any)")
    ca.set_defaults(func=_catalog)

    se = sub.add_parser("sql-endpoint", help="serve the catalog to JDBC/ODBC clients: Spark's Thrift server")
    se.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1; another needs ES_PIPELINE_SQL_ENDPOINT_AUTH=password)")
    se.add_argument("--port", type=int, default=10000, help="port (default 10000)")
    se.add_argument("--add-user", metavar="NAME",
                    help="add or replace a user of the password mode (the password is asked for, or read from "
                    "ES_PIPELINE_NEW_USER_PASSWORD) and exit")
    se.set_defaults(func=_sql_endpoint)

    sp = sub.add_parser("spark", help="Spark set-up")
    sp.add_argument("action", choices=["jars", "serve"],
                    help="jars: resolve the Delta jars into the project cache; serve: run a Spark Connect server")
    sp.add_argument("--port", type=int, default=15002)
    sp.set_defaults(func=_spark)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        from es_pipeline.project import configuration

        args.configuration = configuration(args.component)
        return int(args.func(args, args.configuration.settings) or 0)
    except EsPipelineError as exc:
        print(f"es-pipeline: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"es-pipeline: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a database, Delta or filesystem failure: one line if we know what it means
        known = explain(exc)
        if known is None:
            raise
        print(f"es-pipeline: {known}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
