"""Dagster resources: the event store, the warehouse, Spark. Built from `Settings` in one place."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dagster as dg
from dagster_pyspark import LazyPySparkResource

from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.read.metastore import Metastore
from es_pipeline.lake.spark import prepare_local_start, spark_conf
from es_pipeline.settings import Settings, warehouse_location
from es_pipeline.source import mapping
from es_pipeline.source.mapping import Source
from es_pipeline.store.event_store import EventStore


class EventStoreResource(dg.ConfigurableResource):
    """The PostgreSQL event store: where events are read from and snapshots written back."""

    dsn: str
    schema_name: str = "es"
    # ES_PIPELINE_SOURCE: a preset (`emmett`, `marten`, ...) or a TOML file; "" is the native store in schema_name.
    source: str = ""
    # The snapshot write-back's own login (role es_pipeline_snapshots, docs/security.md); None: `dsn`.
    snapshot_dsn: str | None = None

    def events_source(self) -> Source:
        """Where the events are read, and how (docs/sources.md)."""
        return mapping.load(self.source or None, self.schema_name)

    def store(self) -> EventStore:
        return EventStore.for_source(self.dsn, self.events_source())

    def snapshot_store(self) -> EventStore:
        """The store as the snapshot write-back reaches it."""
        return EventStore.for_source(self.snapshot_dsn or self.dsn, self.events_source())


class WarehouseResource(dg.ConfigurableResource):
    """Where the Delta tables are (`ES_PIPELINE_WAREHOUSE`): a local folder, or an s3:// URI; and which engine works
    on them (`ES_PIPELINE_ENGINE`: auto, spark or local; `lake.kernel.engine.on_spark`); whether a stream type's
    rebuild runs beside the live table or waits (`ES_PIPELINE_REBUILDS`: beside or hold; lake/state/rebuild.py)."""

    path: str
    engine: str = "auto"
    rebuilds: str = "beside"

    @property
    def root(self) -> Path | str:
        return warehouse_location(self.path)


class SparkResource(LazyPySparkResource):
    """PySpark with Delta: the session starts on first use, with the locally cached Delta jars."""

    @property
    def spark_session(self) -> Any:
        if "spark.remote" not in self.spark_config:
            prepare_local_start()
        return super().spark_session


class CatalogResource(dg.ConfigurableResource):
    """The catalog (lake/read/metastore.py): the metastore's PostgreSQL database (`ES_PIPELINE_METASTORE_DSN`, an
    `EnvVar` when set: its password never in Dagster), its schema, and the local Spark configuration a sync starts a
    session with when the catalog differs from the lake."""

    dsn: str  # "off": no catalog
    schema_name: str = "es"
    local_admin: str | None = None  # the local server's, when `dsn` is its `metastore` database (no password)
    spark_config: dict[str, str] = {}

    def metastore(self) -> Metastore | None:
        if not self.dsn or self.dsn.strip().lower() == "off":
            return None
        return Metastore(self.dsn, self.schema_name, self.local_admin)


def engine_of(warehouse: WarehouseResource, spark: SparkResource) -> Engine:
    """Where a table's work runs: the warehouse's engine setting, with the Spark session made only where the rule
    says Spark (lake/kernel/engine.py)."""
    return Engine(warehouse.engine, lambda: spark.spark_session)


def build_resources(settings: Settings) -> dict[str, Any]:
    """The resources `settings` describe. The store's DSN, which may hold a password, enters Dagster as
    `dg.EnvVar("ES_PIPELINE_PG_DSN")`: the UI and Dagster's storage keep the variable's name, not its value.
    Only the local development server's DSN (no password) is given as a value."""
    dsn: Any = dg.EnvVar("ES_PIPELINE_PG_DSN") if settings.pg_dsn_from_env else settings.pg_dsn
    snapshot_dsn: Any = dg.EnvVar("ES_PIPELINE_SNAPSHOT_DSN") if settings.snapshot_dsn else None
    local = Metastore.of(settings)  # None where the catalog is off
    metastore_dsn: Any = dg.EnvVar("ES_PIPELINE_METASTORE_DSN") if os.environ.get("ES_PIPELINE_METASTORE_DSN") \
        else (settings.metastore_dsn or "off")
    return {
        "metastore": CatalogResource(dsn=metastore_dsn, schema_name=settings.catalog_schema,
                                     local_admin=local.local_admin if local else None,
                                     spark_config={k: str(v) for k, v in spark_conf(settings).items()}),
        "event_store": EventStoreResource(dsn=dsn, schema_name=settings.schema, snapshot_dsn=snapshot_dsn,
                                          source=settings.source_spec),
        "warehouse": WarehouseResource(path=str(settings.warehouse), engine=settings.engine,
                                       rebuilds=settings.rebuilds),
        "spark": SparkResource(
            spark_config={"spark.remote": settings.spark_remote} if settings.spark_remote else spark_conf(settings)
        ),
    }
