"""For analysts: every Delta table of the warehouse registered by name in Spark SQL's catalog."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from es_pipeline.lake import inventory
from es_pipeline.lake.delta import tables
from es_pipeline.lake.delta.tables import Location
from es_pipeline.lake.read.as_of import as_of_spark
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
    """`query` as a Spark DataFrame over every table of the lake by name (`es-pipeline sql`); the names."""
    spark = get_spark(settings, master=settings.spark_master)
    names = register_tables(spark, settings.warehouse)

    def columns_of(name: str) -> list[str]:  # a history table's, for `state_as_of` (lake/read/query.py)
        if name not in names:
            raise KeyError(name)
        return [f.name for f in spark.table(name).schema.fields]

    return spark.sql(as_of_spark(query, columns_of)), names
