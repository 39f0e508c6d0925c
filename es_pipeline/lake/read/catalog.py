"""For analysts: every Delta table of the warehouse by name in Spark SQL: the catalog's (the Hive metastore,
lake/read/metastore.py), or, with no catalog (`ES_PIPELINE_METASTORE_DSN=off`) or in a process whose Spark session
was started without it, names registered in the session's own catalog for the query."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from es_pipeline.lake import inventory
from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.read.as_of import as_of_spark
from es_pipeline.lake.read.metastore import Metastore, catalog_session, sync, wanted
from es_pipeline.lake.spark import get_spark
from es_pipeline.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def register_tables(spark: SparkSession, warehouse: Location) -> list[str]:
    """Register each Delta table under the warehouse as a table of its name (time travel works)."""
    names = []
    for name in inventory.lake_tables(warehouse):
        path = tables.table_path(warehouse, name)
        if tables.is_delta_table(path):
            # External tables: DROP forgets the name, never the files; re-pointing keeps the name current.
            spark.sql(f"DROP TABLE IF EXISTS {name}")
            spark.sql(f"CREATE TABLE {name} USING delta LOCATION '{path}'")
            names.append(name)
    return names


def sql_over_lake(settings: Settings, query: str) -> tuple[Any, list[str]]:
    """`query` as a Spark DataFrame over every table of the lake by name (`es-pipeline sql`); the names.

    With the catalog, the catalog is synced first and the query runs in its schema (`es`): no table is created for
    the query."""
    spark, names = _with_catalog(settings)
    if spark is None:
        spark = get_spark(settings, master=settings.spark_master)
        names = register_tables(spark, settings.warehouse)

    def columns_of(name: str) -> list[str]:  # a history table's, for `state_as_of` (lake/read/query.py)
        if name not in names:
            raise KeyError(name)
        return [f.name for f in spark.table(name).schema.fields]

    return spark.sql(as_of_spark(query, columns_of)), names


def _with_catalog(settings: Settings) -> tuple[Any, list[str]]:
    """A session with the catalog, synced, in its schema, and the lake's names; (None, []) where there is none."""
    from pyspark.sql import SparkSession

    metastore = Metastore.of(settings)
    if metastore is None:
        return None, []
    running = SparkSession.getActiveSession()
    if running is not None and running.conf.get("spark.sql.catalogImplementation", "in-memory") != "hive":
        return None, []
    spark = catalog_session(settings, metastore)
    sync(settings, spark=spark)
    spark.catalog.setCurrentDatabase(metastore.schema)
    return spark, sorted(wanted(settings.warehouse))
