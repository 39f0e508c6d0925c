"""`es-pipeline doctor`: everything a first run needs, checked, with one line each of what is wrong and what to do.

The team's domain imports; the store answers, holds the source table, and its migrations are applied; the lake's
folder can be written (or its object store read); Java and the Delta jars are there where Spark may run; the
Dagster instance has the settings es_pipeline relies on (INSTANCE_NEEDS). Nothing is changed: a check that finds
something to do names the command that does it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from es_pipeline.errors import EsPipelineError, explain
from es_pipeline.settings import Settings

OK, WARN, FAIL = "ok", "warn", "FAIL"

# The instance settings es_pipeline relies on (docs/quickstart.md, "The Dagster instance"): never two runs of a
# slice range at once, and a dead run's place in the queue freed.
INSTANCE_NEEDS: dict[str, Callable[[dict], bool]] = {
    "tag concurrency per range (concurrency.runs.tag_concurrency_limits on es_pipeline/slice_range)":
        lambda conf: any(limit.get("key") == "es_pipeline/slice_range"
                         for limit in ((conf.get("concurrency") or {}).get("runs") or {}).get("tag_concurrency_limits")
                         or []),
    "run monitoring (run_monitoring.enabled)": lambda conf: bool((conf.get("run_monitoring") or {}).get("enabled")),
}


def instance_gaps(dagster_home: str | os.PathLike | None) -> list[str]:
    """What the Dagster instance at `dagster_home` lacks of INSTANCE_NEEDS (all of it without a dagster.yaml)."""
    conf_file = Path(dagster_home) / "dagster.yaml" if dagster_home else None
    if conf_file is None or not conf_file.is_file():
        return list(INSTANCE_NEEDS)
    try:
        conf = yaml.safe_load(conf_file.read_text()) or {}
    except yaml.YAMLError:
        return list(INSTANCE_NEEDS)
    return [need for need, held in INSTANCE_NEEDS.items() if not held(conf)]


def recommended_instance_yaml() -> str:
    """The dagster.yaml es_pipeline recommends for a dg project (es_pipeline/instance/dagster.yaml)."""
    return (Path(__file__).resolve().parent.parent / "instance" / "dagster.yaml").read_text()


@dataclass(frozen=True)
class Finding:
    level: str  # OK, WARN or FAIL
    what: str
    line: str


def _failure(exc: BaseException) -> str:
    if isinstance(exc, EsPipelineError):
        return str(exc)
    known = explain(exc)
    return str(known) if known else f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def check_domain(settings: Settings) -> Finding:
    from es_pipeline.domain import load

    if not settings.domain_modules:
        return Finding(WARN, "domain", f"none set ({settings.origin('ES_PIPELINE_DOMAIN')}): stream_state rows "
                       "will have no state; name the module of your reducers")
    try:
        domain = load(settings.domain_modules, settings.origin("ES_PIPELINE_DOMAIN"))
    except Exception as exc:  # noqa: BLE001 - a team's module may raise anything at import: said in one line
        return Finding(FAIL, "domain", _failure(exc))
    return Finding(OK, "domain", f"{', '.join(settings.domain_modules)}: {len(domain.reducers)} reducer(s) "
                   f"({', '.join(sorted(domain.reducers)) or '-'}), {len(domain.upcasters)} upcaster(s), "
                   f"{len(domain.projections)} cross-stream projection(s), {len(domain.event_schemas)} typed event "
                   "table(s)")


def check_store(settings: Settings) -> list[Finding]:
    from es_pipeline.store.conninfo import connect, describe
    from es_pipeline.store.migrations import MIGRATIONS, applied_versions

    host, port, dbname = describe(settings.pg_dsn)
    where = f"{host}:{port}/{dbname}"
    try:
        conn = connect(settings.pg_dsn, autocommit=True)
    except Exception as exc:  # noqa: BLE001 - one line of what failed
        return [Finding(FAIL, "store", _failure(exc))]
    found = []
    with conn:
        version = (conn.execute("SHOW server_version").fetchone() or ("?",))[0]
        found.append(Finding(OK, "store", f"{where} answers (PostgreSQL {version})"))
        source = settings.source
        if source.native:
            done = applied_versions(conn, settings.schema)
            pending = [m.version for m in MIGRATIONS if m.version not in done]
            if pending:
                found.append(Finding(FAIL, "migrations", f"{len(pending)} of {len(MIGRATIONS)} not applied to schema "
                                     f"{settings.schema!r}: run `es-pipeline db migrate`"))
            else:
                found.append(Finding(OK, "migrations", f"schema {settings.schema!r} is up to date "
                                     f"({len(MIGRATIONS)} migrations)"))
        else:
            exists = (conn.execute("SELECT to_regclass(%s) IS NOT NULL", (source.qualified_table,)).fetchone() or (0,))[0]
            found.append(Finding(OK if exists else FAIL, "source",
                                 f"{source.label}: table {source.qualified_table} " + ("present" if exists else
                                 "missing: check ES_PIPELINE_SOURCE, then `es-pipeline source adopt`")))
    return found


def check_lake(settings: Settings) -> Finding:
    from es_pipeline.lake.delta.tables import is_delta_table, table_path
    from es_pipeline.lake.inventory import lake_tables

    warehouse = settings.warehouse
    origin = settings.origin("ES_PIPELINE_WAREHOUSE")
    if isinstance(warehouse, Path):
        probe = next((p for p in (warehouse, *warehouse.parents) if p.exists()), None)
        if probe is None or not os.access(probe, os.W_OK):
            return Finding(FAIL, "lake", f"{warehouse} ({origin}) cannot be written here: choose a folder you own")
    try:
        tables = [t for t in lake_tables(warehouse) if is_delta_table(table_path(warehouse, t))]
    except Exception as exc:  # noqa: BLE001 - object storage unreachable, keys refused: one line
        return Finding(FAIL, "lake", f"{warehouse} ({origin}): {_failure(exc)}")
    return Finding(OK, "lake", f"{warehouse} ({origin}): " + (f"{len(tables)} table(s): {', '.join(tables[:8])}"
                   if tables else "no table yet (`es-pipeline materialize` makes them)"))


def check_spark(settings: Settings) -> list[Finding]:
    from es_pipeline.lake.spark import delta_jars, jars_dir
    from es_pipeline.lake.spark.java import java_binary

    if settings.spark_remote:
        return [Finding(OK, "spark", f"Spark Connect at {settings.spark_remote} (ES_PIPELINE_SPARK_REMOTE): no local "
                        "Java needed")]
    needed = settings.engine == "spark"
    level = FAIL if needed else WARN
    why = "ES_PIPELINE_ENGINE=spark" if needed else "engine auto: Spark builds tables once `events` passes 1 GiB"
    java = java_binary()
    if java is None:
        return [Finding(level, "java", f"no Java 17 or 21 found ({why}): install a JDK, or the `portable` extra")]
    found = [Finding(OK, "java", java)]
    try:
        delta_jars(resolve=False)
        found.append(Finding(OK, "jars", f"Delta jars in {jars_dir()}"))
    except EsPipelineError:
        found.append(Finding(WARN, "jars", f"not fetched yet into {jars_dir()}: the first Spark start fetches about "
                             "21 MB from Maven Central, or run `es-pipeline spark jars` now"))
    return found


def check_catalog(settings: Settings) -> Finding:
    """The catalog (lake/read/metastore.py): reachable, and naming exactly the lake's tables."""
    from es_pipeline.lake.read import metastore

    try:
        ms = metastore.Metastore.of(settings)
        if ms is None:
            return Finding(OK, "catalog", "off (ES_PIPELINE_METASTORE_DSN=off): tables by path and `es-pipeline sql` "
                           "only")
        registered = metastore.registered(ms)
        diff = metastore.difference(ms, settings.warehouse)
    except Exception as exc:  # noqa: BLE001 - the catalog's database unreachable, refused: one line
        return Finding(WARN, "catalog", f"{_failure(exc)} (tables by name need it: docs/analysts.md)")
    if not registered and diff.missing:
        return Finding(WARN, "catalog", f"no table in `{ms.schema}` yet: `es-pipeline catalog sync` registers the "
                       f"lake's {len(diff.missing)}")
    if diff:
        return Finding(FAIL, "catalog", f"`{ms.schema}` differs from the lake: {diff.describe()}; "
                       "`es-pipeline catalog sync` (the `catalog` asset does it on its sensor)")
    return Finding(OK, "catalog", f"`{ms.schema}` names the lake's {len(registered)} table(s)")


def check_instance(settings: Settings) -> Finding:
    home = os.environ.get("DAGSTER_HOME")
    if not home:
        return Finding(WARN, "dagster", "DAGSTER_HOME is not in the environment: es-pipeline's own commands use "
                       f"{settings.dagster_home} (as `es-pipeline config` shows), but `dg dev` keeps runs in a "
                       "temporary instance; export it and put `es-pipeline dagster-yaml` in its dagster.yaml")
    gaps = instance_gaps(home)
    if gaps:
        return Finding(WARN, "dagster", f"{home}/dagster.yaml lacks {' and '.join(gaps)}: `es-pipeline dagster-yaml` "
                       "prints the settings to add")
    return Finding(OK, "dagster", f"{home}/dagster.yaml has tag concurrency per range and run monitoring")


def diagnose(settings: Settings) -> list[Finding]:
    """Every check, in the order a first run meets them."""
    return [check_domain(settings), *check_store(settings), check_lake(settings), *check_spark(settings),
            check_catalog(settings), check_instance(settings)]
