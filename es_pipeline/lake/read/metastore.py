"""Every table of the lake by name, for any engine and SQL client: a Hive metastore whose database is PostgreSQL.

The catalog holds each Delta table es_pipeline keeps (`inventory.lake_tables`) as an external table at its location,
in one schema (`ES_PIPELINE_CATALOG_SCHEMA`, `es`): Spark sessions with the catalog, Spark's Thrift server (the SQL
endpoint, lake/read/endpoint.py) and every client of it see the lake's tables by name. Delta keeps a table's schema in
its log, so a table is registered once: its new versions, a swap, an erasure or a rebuild in place need nothing more.

Kept exact by a sync (`sync`): it compares the lake with the catalog without a JVM (the catalog's rows, read from
PostgreSQL), and starts Spark only to register or drop the difference. Small runs never start a JVM for it
(decision 0052).

The metastore's tables are made once, by DataNucleus's own SchemaTool (the ORM Hive's metastore is written on) from
the mapping in Spark's `hive-metastore` jar, alone, before any Spark session uses the database. Left to the metastore's
`datanucleus.schema.autoCreateAll`, the first Spark session hangs on PostgreSQL: a foreign key added on one connection
waits for a lock another connection of the same metastore holds.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg

from es_pipeline.errors import MetastoreError
from es_pipeline.lake import inventory
from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.tables import Location
from es_pipeline.settings import Settings, local_pg_dsn

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

OFF = "off"
_NAME = re.compile(r"[a-z_][a-z0-9_]{0,127}")
# A session lock in the metastore's database while its tables are made: two first syncs never both run SchemaTool.
_SCHEMA_LOCK = 0x65735F6D65746173  # "es_metas"
SCHEMA_TOOL = "org.datanucleus.store.schema.SchemaTool"


@dataclass(frozen=True)
class Metastore:
    """Where the catalog is: a PostgreSQL database (a libpq DSN, its password never in it) and the schema."""

    dsn: str
    schema: str = "es"
    # The local development server's `metastore` database (the default): made on first use, as the store's is.
    local_admin: str | None = None

    @classmethod
    def of(cls, settings: Settings) -> Metastore | None:
        """The configured catalog, or None when `ES_PIPELINE_METASTORE_DSN` is `off`."""
        dsn = settings.metastore_dsn
        if not dsn or dsn.strip().lower() == OFF:
            return None
        if not _NAME.fullmatch(settings.catalog_schema):
            raise MetastoreError(f"ES_PIPELINE_CATALOG_SCHEMA {settings.catalog_schema!r} is not a schema name: use "
                                 "lower-case letters, digits and underscores (default `es`)")
        local = dsn == local_pg_dsn(settings.local_pg_port, "metastore")
        return cls(dsn, settings.catalog_schema, local_pg_dsn(settings.local_pg_port, "postgres") if local else None)

    @classmethod
    def required(cls, settings: Settings) -> Metastore:
        metastore = cls.of(settings)
        if metastore is None:
            raise MetastoreError("no catalog: ES_PIPELINE_METASTORE_DSN is `off`. Set it to a PostgreSQL database the "
                                 "catalog may own (docs/analysts.md, \"The catalog\")")
        return metastore

    def connect(self, *, create: bool = False) -> psycopg.Connection[Any]:
        """A connection to the catalog's database; `create`: the local server's is made if it is not there."""
        try:
            return psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
        except psycopg.OperationalError as exc:
            if create and self.local_admin and "does not exist" in str(exc):
                with psycopg.connect(self.local_admin, autocommit=True) as admin:
                    try:
                        admin.execute("CREATE DATABASE metastore")
                    except psycopg.errors.DuplicateDatabase:
                        pass  # another process made it first
                return psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
            raise MetastoreError(f"cannot reach the catalog's database (ES_PIPELINE_METASTORE_DSN): "
                                 f"{_first_line(exc)}. Create it, owned by the catalog's login "
                                 "(docs/analysts.md, \"The catalog\"), or set ES_PIPELINE_METASTORE_DSN=off") from None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


# -- the JVM's view of the database ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Jdbc:
    """The metastore's database as DataNucleus connects to it. The password is read by libpq (passfile, PGPASSWORD,
    a service file): it goes to a JVM through its configuration, never a command line, and is never printed."""

    url: str
    user: str
    password: str = field(repr=False)

    def properties(self) -> dict[str, str]:
        """Hive's metastore settings (as `spark.hadoop.` configuration or hive-site): PostgreSQL, the tables made
        up front (`ensure_schema`), no schema version check (DataNucleus made the tables, not Hive's scripts)."""
        return {
            "javax.jdo.option.ConnectionURL": self.url,
            "javax.jdo.option.ConnectionDriverName": "org.postgresql.Driver",
            "javax.jdo.option.ConnectionUserName": self.user,
            "javax.jdo.option.ConnectionPassword": self.password,
            "datanucleus.schema.autoCreateAll": "true",  # only SEQUENCE_TABLE is left: no foreign key, no lock
            "hive.metastore.schema.verification": "false",
            "hive.metastore.schema.verification.record.version": "false",
        }


def jdbc(metastore: Metastore) -> Jdbc:
    with metastore.connect() as conn:
        info = conn.info
        params = info.get_parameters()
        extra = f"&sslmode={params['sslmode']}" if params.get("sslmode") in {"require", "verify-ca", "verify-full"} \
            else ""
        return Jdbc(f"jdbc:postgresql://{info.host}:{info.port}/{info.dbname}?ApplicationName=es_pipeline-catalog"
                    f"{extra}", info.user, info.password or "")


def spark_catalog_conf(metastore: Metastore) -> dict[str, str]:
    """What a Spark session adds to `spark_conf` to have the catalog: Hive's catalog on this database, with the
    PostgreSQL driver on the driver's class path (the metastore's client loads it there)."""
    from es_pipeline.lake.spark import expected_jars

    driver = next(str(j) for j in expected_jars() if "postgresql" in j.name)
    conf = {f"spark.hadoop.{k}": v for k, v in jdbc(metastore).properties().items()}
    return {**conf, "spark.sql.catalogImplementation": "hive", "spark.driver.extraClassPath": driver}


# -- the metastore's tables, made once -----------------------------------------------------------------------------


def has_schema(conn: psycopg.Connection[Any]) -> bool:
    return conn.execute("SELECT to_regclass('public.\"TBLS\"') IS NOT NULL AND "
                        "to_regclass('public.\"DBS\"') IS NOT NULL").fetchone()[0]  # type: ignore[index]


def ensure_schema(metastore: Metastore, say: Callable[[str], None] = lambda line: None) -> bool:
    """Make the metastore's tables if the database has none (DataNucleus's SchemaTool, about 3 s); True if made."""
    with metastore.connect(create=True) as conn:
        if has_schema(conn):
            return False
        conn.execute("SELECT pg_advisory_lock(%s)", [_SCHEMA_LOCK])
        try:
            if has_schema(conn):
                return False
            say("catalog: making the metastore's tables in its PostgreSQL database (once)")
            _schema_tool(jdbc(metastore))
            if not has_schema(conn):
                raise MetastoreError("DataNucleus's SchemaTool ended without making the metastore's tables")
            return True
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", [_SCHEMA_LOCK])


def _schema_tool(db: Jdbc) -> None:
    import pyspark

    from es_pipeline.lake.spark import expected_jars, prepare_local_start
    from es_pipeline.lake.spark.java import java_binary

    prepare_local_start()
    java = java_binary()
    jars = Path(pyspark.__file__).parent / "jars"
    metastore_jar = next(jars.glob("hive-metastore-*.jar"))
    driver = next(str(j) for j in expected_jars() if "postgresql" in j.name)
    with tempfile.TemporaryDirectory(prefix="es_pipeline-catalog-") as tmp:
        work = Path(tmp)
        with zipfile.ZipFile(metastore_jar) as jar:  # the model's mapping, as SchemaTool reads it: a file
            (work / "package.jdo").write_bytes(jar.read("package.jdo"))
        props = work / "datanucleus.properties"
        props.touch(mode=0o600)
        props.write_text("".join(f"{k}={v}\n" for k, v in {
            "javax.jdo.PersistenceManagerFactoryClass": "org.datanucleus.api.jdo.JDOPersistenceManagerFactory",
            **db.properties(),
            # As Hive's metastore names its tables and columns (HiveConf's defaults).
            "datanucleus.identifierFactory": "datanucleus1",
            "datanucleus.rdbms.useLegacyNativeValueStrategy": "true",
            "datanucleus.storeManagerType": "rdbms",
        }.items()))
        done = subprocess.run([java or "java", "-cp", f"{jars}/*:{driver}", SCHEMA_TOOL, "-create", "-api", "JDO",
                               "-props", str(props), "package.jdo"],
                              cwd=work, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or "completed successfully" not in done.stdout:
            tail = (done.stdout + done.stderr).replace(db.password, "***") if db.password else done.stdout + done.stderr
            raise MetastoreError(f"DataNucleus's SchemaTool failed (exit {done.returncode}): "
                                 f"{tail.strip()[-800:]}")


# -- the lake against the catalog, without a JVM -------------------------------------------------------------------


def location_key(location: str) -> str:
    """A location as both sides can compare it: Spark records `file:/x` for `/x` and may name S3 `s3a://`."""
    if location.startswith("file:"):
        location = "/" + location[len("file:"):].lstrip("/")
    elif location.startswith("s3a://"):
        location = "s3://" + location[len("s3a://"):]
    return location.rstrip("/")


def wanted(warehouse: Location) -> dict[str, str]:
    """The lake's tables now, each at its location: what the catalog should name."""
    found = {}
    for name in inventory.lake_tables(warehouse):
        path = tables.table_path(warehouse, name)
        if tables.is_delta_table(path):
            found[name] = path
    return found


def never_synced(metastore: Metastore) -> bool:
    """No sync has made the catalog yet: the local server's database is not there, or has no metastore tables."""
    try:
        with metastore.connect() as conn:
            return not has_schema(conn)
    except MetastoreError:
        if metastore.local_admin:
            with psycopg.connect(metastore.local_admin, autocommit=True, connect_timeout=10) as admin:
                return admin.execute("SELECT 1 FROM pg_database WHERE datname = 'metastore'").fetchone() is None
        raise


def registered(metastore: Metastore) -> dict[str, str]:
    """The catalog's tables in the schema, each at its recorded location (read from PostgreSQL; {} before the
    first sync)."""
    if never_synced(metastore):
        return {}
    with metastore.connect() as conn:
        rows = conn.execute(
            'SELECT t."TBL_NAME", coalesce(p."PARAM_VALUE", s."LOCATION", \'\') FROM "TBLS" t '
            'JOIN "DBS" d ON d."DB_ID" = t."DB_ID" '
            'LEFT JOIN "SDS" s ON s."SD_ID" = t."SD_ID" '
            'LEFT JOIN "SERDE_PARAMS" p ON p."SERDE_ID" = s."SERDE_ID" AND p."PARAM_KEY" = \'path\' '
            'WHERE d."NAME" = %s', [metastore.schema]).fetchall()
    return {name: location for name, location in rows}


@dataclass(frozen=True)
class Difference:
    """What the catalog lacks, what it names that the lake no longer has, and names at another location."""

    missing: dict[str, str]
    extra: list[str]
    moved: dict[str, str]

    def __bool__(self) -> bool:
        return bool(self.missing or self.extra or self.moved)

    def describe(self) -> str:
        parts = [f"{len(self.missing)} missing ({', '.join(sorted(self.missing))})" if self.missing else "",
                 f"{len(self.extra)} not in the lake ({', '.join(sorted(self.extra))})" if self.extra else "",
                 f"{len(self.moved)} at another location ({', '.join(sorted(self.moved))})" if self.moved else ""]
        return "; ".join(p for p in parts if p) or "none"


def difference(metastore: Metastore, warehouse: Location) -> Difference:
    lake = wanted(warehouse)
    catalog = registered(metastore)
    return Difference(
        missing={n: p for n, p in lake.items() if n not in catalog},
        extra=sorted(n for n in catalog if n not in lake),
        moved={n: p for n, p in lake.items() if n in catalog and location_key(catalog[n]) != location_key(p)},
    )


# -- the sync ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Synced:
    schema: str
    tables: int  # the catalog's tables in the schema, after
    registered: list[str]
    dropped: list[str]
    seconds: float
    jvm: bool  # whether the sync started (or used) Spark: only when the catalog differed from the lake


def catalog_session(settings: Settings, metastore: Metastore) -> SparkSession:
    """A local Spark session with the catalog, on the project's Spark configuration."""
    from es_pipeline.lake.spark import spark_conf

    return session_with(spark_conf(settings, master=settings.spark_master), metastore)


def session_with(conf: dict[str, Any], metastore: Metastore) -> SparkSession:
    """A classic Spark session of `conf` with the catalog (the metastore's tables made first). A process whose
    session was started without it cannot gain it: Hive's catalog is fixed at a session's start."""
    from pyspark.sql import SparkSession

    from es_pipeline.lake.spark import prepare_local_start

    ensure_schema(metastore)
    prepare_local_start()
    builder = SparkSession.builder
    for key, value in {**conf, **spark_catalog_conf(metastore)}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if spark.conf.get("spark.sql.catalogImplementation", "in-memory") != "hive":
        raise MetastoreError("this process's Spark session was started without the catalog; run the sync in a "
                             "process of its own (`es-pipeline catalog sync`)")
    return spark


def sync(settings: Settings, *, spark: SparkSession | None = None,
         say: Callable[[str], None] = lambda line: None) -> Synced:
    """The catalog of `settings` made equal to its lake (`sync_lake`)."""
    metastore = Metastore.required(settings)
    return sync_lake(metastore, settings.warehouse, spark or (lambda: catalog_session(settings, metastore)), say)


def sync_lake(metastore: Metastore, warehouse: Location, spark: SparkSession | Callable[[], SparkSession],
              say: Callable[[str], None] = lambda line: None) -> Synced:
    """Register the lake's tables the catalog lacks and drop those the lake no longer has. `spark`: a session with
    the catalog, or what makes one, called only if the catalog differs from the lake."""
    started = time.monotonic()
    ensure_schema(metastore, say)
    diff = difference(metastore, warehouse)
    added: list[str] = []
    dropped: list[str] = []
    given = not callable(spark)
    if diff or given:
        session = spark if given else spark()  # type: ignore[operator]
        added, dropped = apply(session, metastore.schema, diff, say)  # type: ignore[arg-type]
        diff = difference(metastore, warehouse)
        if diff:
            raise MetastoreError(f"the catalog still differs from the lake after the sync: {diff.describe()}")
    return Synced(metastore.schema, len(registered(metastore)), added, dropped, time.monotonic() - started,
                  bool(added or dropped or given))


def apply(spark: SparkSession, schema: str, diff: Difference,
          say: Callable[[str], None] = lambda line: None) -> tuple[list[str], list[str]]:
    """The difference, on Spark's catalog, as external tables (DROP forgets a name, never the files): the names
    registered and those dropped."""
    added: list[str] = []
    dropped: list[str] = []
    spark.sql(f"CREATE DATABASE IF NOT EXISTS `{schema}`")
    for name in [*diff.extra, *diff.moved]:
        spark.sql(f"DROP TABLE IF EXISTS `{schema}`.`{name}`")
        if name in diff.extra:
            dropped.append(name)
            say(f"catalog: dropped {schema}.{name} (not in the lake)")
    for name, path in [*diff.missing.items(), *diff.moved.items()]:
        spark.sql(f"CREATE TABLE IF NOT EXISTS `{schema}`.`{name}` USING delta LOCATION '{_quoted(path)}'")
        added.append(name)
        say(f"catalog: registered {schema}.{name} at {path}")
    return added, dropped


def _quoted(path: str) -> str:
    return path.replace("\\", "\\\\").replace("'", "\\'")


def spark_with_catalog(settings: Settings | None = None) -> SparkSession:
    """A notebook's Spark session with Delta and the catalog, in its schema: every lake table by name
    (`es.stream_state`, or `stream_state`). Reads the catalog as the `catalog` asset keeps it; syncs nothing."""
    settings = settings or Settings.from_env()
    metastore = Metastore.required(settings)
    spark = catalog_session(settings, metastore)
    spark.sql(f"CREATE DATABASE IF NOT EXISTS `{metastore.schema}`")
    spark.catalog.setCurrentDatabase(metastore.schema)
    return spark
