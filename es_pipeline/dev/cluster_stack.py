"""`make dev-cluster`: the distributed set-up on this machine, with no clicks. A real S3 server (s3proxy)
holds the lake, a Spark standalone cluster (a master and a worker) does the Spark work through a Spark
Connect server on it, and then `make dev`'s loop runs on them: demo writers, Dagster's UI and daemon with
the sensor on. Ctrl-C stops everything; the lake's objects stay in `.s3data/` for the next start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import ExitStack

from es_pipeline.dev import local_server
from es_pipeline.dev.s3proxy import s3proxy
from es_pipeline.dev.spark_cluster import standalone
from es_pipeline.settings import LOCAL_PG_PASSFILE, PROJECT_ROOT, Settings, dagster_storage_url, local_pg_dsn
from es_pipeline.store.migrations import migrate

S3_PORT = int(os.environ.get("ES_PIPELINE_S3_PORT", "9010"))
CLUSTER_STORE, CLUSTER_DAGSTER, CLUSTER_CATALOG = "es_pipeline_cluster", "dagster_cluster", "metastore_cluster"


def main() -> int:
    with ExitStack() as stack:
        s3 = stack.enter_context(s3proxy(PROJECT_ROOT / ".s3data" / "objects", port=S3_PORT))
        warehouse = f"{s3.bucket('lake')}/warehouse"
        print(f"S3 (s3proxy) on {s3.endpoint}; the lake at {warehouse}", flush=True)
        os.environ.update(s3.client_env())  # the cluster's executors inherit them from the worker
        cluster = stack.enter_context(standalone(PROJECT_ROOT / ".spark-cluster", cores=2, memory="4g"))
        print(f"Spark standalone master {cluster.master_url} (UI {cluster.web_ui}), one worker", flush=True)
        env = {**os.environ, "ES_PIPELINE_WAREHOUSE": warehouse, "ES_PIPELINE_SPARK_MASTER": cluster.master_url,
               # A store and a Dagster storage of its own: the offsets of `make dev`'s local lake are bound to
               # that lake, and a run pointed at another one refuses (rightly) instead of extracting.
               "ES_PIPELINE_PG_DSN": _own_database(CLUSTER_STORE), "DAGSTER_PG_URL": _dagster_url(CLUSTER_DAGSTER),
               # A catalog of its own too: one catalog names one lake (a sync drops the names of any other).
               "ES_PIPELINE_METASTORE_DSN": _catalog_database(CLUSTER_CATALOG)}
        # `make dev`'s loop: a Spark Connect server (here a driver on the cluster), writers, Dagster. Ctrl-C
        # reaches dev.sh as well, which stops its children: wait for it, then stop the cluster and s3proxy.
        loop = subprocess.Popen(["bash", str(PROJECT_ROOT / "scripts" / "dev.sh")], env=env)
        signal.signal(signal.SIGTERM, lambda *_: loop.send_signal(signal.SIGTERM))  # `kill`: the same, politely
        while True:
            try:
                return loop.wait()
            except KeyboardInterrupt:
                continue


def _own_database(name: str) -> str:
    """A database of the local server, created and migrated if missing; its DSN."""
    settings = Settings.from_env()
    local_server.create_database(name, settings.local_pg_port)
    dsn = local_pg_dsn(settings.local_pg_port, name)
    migrate(dsn, settings.schema)
    return dsn


def _catalog_database(name: str) -> str:
    """The catalog's database on the local server, created if missing (its tables: the first sync); its DSN."""
    port = Settings.from_env().local_pg_port
    local_server.create_database(name, port)
    return local_pg_dsn(port, name)


def _dagster_url(name: str) -> str:
    """Dagster's storage in a database of the local server of its own."""
    port = Settings.from_env().local_pg_port
    local_server.create_database(name, port)
    return dagster_storage_url("postgres", "127.0.0.1", port, name, str(LOCAL_PG_PASSFILE))


if __name__ == "__main__":
    sys.exit(main())
