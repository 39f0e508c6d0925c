"""`make dev-cluster`: the distributed set-up on this machine, with no clicks. A real S3 server (s3proxy)
holds the lake, a Spark standalone cluster (a master and a worker) does the Spark work through a Spark
Connect server on it, and then `make dev`'s loop runs on them: demo writers, Dagster's UI and daemon with
the sensor on. Ctrl-C stops everything; the lake's objects stay in `.s3data/` for the next start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import ExitStack

from es_pipeline.dev.s3proxy import s3proxy
from es_pipeline.dev.spark_cluster import standalone
from es_pipeline.settings import PROJECT_ROOT

S3_PORT = int(os.environ.get("ES_PIPELINE_S3_PORT", "9010"))


def main() -> int:
    with ExitStack() as stack:
        s3 = stack.enter_context(s3proxy(PROJECT_ROOT / ".s3data" / "objects", port=S3_PORT))
        warehouse = f"{s3.bucket('lake')}/warehouse"
        print(f"S3 (s3proxy) on {s3.endpoint}; the lake at {warehouse}", flush=True)
        os.environ.update(s3.client_env())  # the cluster's executors inherit them from the worker
        cluster = stack.enter_context(standalone(PROJECT_ROOT / ".spark-cluster", cores=2, memory="4g"))
        print(f"Spark standalone master {cluster.master_url} (UI {cluster.web_ui}), one worker", flush=True)
        env = {**os.environ, "ES_PIPELINE_WAREHOUSE": warehouse, "ES_PIPELINE_SPARK_MASTER": cluster.master_url}
        try:
            # `make dev`'s loop: a Spark Connect server (here a driver on the cluster), writers, Dagster.
            return subprocess.run(["bash", str(PROJECT_ROOT / "scripts" / "dev.sh")], env=env, check=False).returncode
        except KeyboardInterrupt:
            return 130


if __name__ == "__main__":
    sys.exit(main())
