"""The PostgreSQL JDBC driver for the plain-Spark comparison: the one es_pipeline caches with the Delta jars."""

from __future__ import annotations

from pathlib import Path

from es_pipeline.errors import SparkSetupError
from es_pipeline.lake.spark import delta_jars
from es_pipeline.store.conninfo import jdbc_url

__all__ = ["jdbc_jar", "jdbc_url"]


def jdbc_jar() -> Path:
    """The local JDBC driver jar (resolved from Maven Central once, by `es-pipeline spark jars`)."""
    for jar in delta_jars():
        if jar.name.startswith("org.postgresql-postgresql"):
            return jar
    raise SparkSetupError("the PostgreSQL JDBC driver is not in the jar cache; run `es-pipeline spark jars`")
