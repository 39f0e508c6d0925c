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
            spark.sql(f"CREATE TABLE IF NOT EXISTS {name} USING delta LOCATION '{path}'")
            names.append(name)
    return names
