"""The PostgreSQL JDBC driver for the plain-Spark comparison, resolved once like the Delta jars.

pyspark's bundled Ivy jar fetches `org.postgresql:postgresql` with `-notransitive` (its one
dependency, checker-qual, holds compile-time annotations only) into `.cache/jars-jdbc/`; later
runs use the local file.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict

from es_pipeline.spark import JAR_CACHE, SparkSetupError

JDBC_GROUP = "org.postgresql"
JDBC_ARTIFACT = "postgresql"
JDBC_VERSION = "42.7.14"
JDBC_DRIVER_CLASS = "org.postgresql.Driver"


def jdbc_jar() -> Path:
    """The local JDBC driver jar, fetched from Maven Central the first time."""
    target = JAR_CACHE / "jars-jdbc"
    jar = target / f"{JDBC_GROUP}-{JDBC_ARTIFACT}-{JDBC_VERSION}.jar"
    if jar.exists():
        return jar
    import pyspark

    ivy_jar = next((Path(pyspark.__file__).parent / "jars").glob("ivy-*.jar"), None)
    java = shutil.which("java")
    if ivy_jar is None or java is None:
        raise SparkSetupError("cannot resolve the JDBC driver: need `java` on PATH and pyspark's bundled Ivy jar.")
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=JAR_CACHE) as tmp:
        cmd = [
            java, "-jar", str(ivy_jar),
            "-dependency", JDBC_GROUP, JDBC_ARTIFACT, JDBC_VERSION,
            "-confs", "default",
            "-notransitive",
            "-cache", str(JAR_CACHE / "ivy"),
            "-retrieve", f"{tmp}/[organisation]-[artifact]-[revision].[ext]",
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        fetched = Path(tmp) / jar.name
        if res.returncode != 0 or not fetched.exists():
            raise SparkSetupError(
                f"resolving {JDBC_GROUP}:{JDBC_ARTIFACT}:{JDBC_VERSION} from Maven Central failed:\n"
                + "\n".join(res.stdout.splitlines()[-15:])
            )
        partial = target / (jar.name + ".part")
        shutil.copy2(fetched, partial)
        partial.replace(jar)  # atomic: a half-copied jar is never taken for a resolved one
    return jar


def jdbc_url(dsn: str) -> tuple[str, dict[str, str]]:
    """A psycopg DSN as Spark's JDBC URL and connection properties."""
    parts = conninfo_to_dict(dsn)
    host = parts.get("host", "localhost")
    port = parts.get("port", "5432")
    props = {"user": str(parts.get("user", "postgres")), "driver": JDBC_DRIVER_CLASS}
    if parts.get("password"):
        props["password"] = str(parts["password"])
    return f"jdbc:postgresql://{host}:{port}/{parts.get('dbname', '')}", props
