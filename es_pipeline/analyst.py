"""For analysts: every Delta table of the warehouse registered by name in a Spark session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from es_pipeline import lake


def register_tables(spark: Any, warehouse: Path) -> list[str]:
    """Register each Delta table under the warehouse as a table of its name (time travel works)."""
    names = []
    for name in lake.TABLES:
        path = lake.table_path(warehouse, name)
        if lake.is_delta_table(path):
            # External tables: DROP forgets the name, never the files; re-pointing keeps the name current.
            spark.sql(f"DROP TABLE IF EXISTS {name}")
            spark.sql(f"CREATE TABLE {name} USING delta LOCATION '{path}'")
            names.append(name)
    return names
