"""A Spark standalone cluster on this machine, from the pyspark package itself: a master and a worker
started with its `sbin/spark-daemon.sh` (SPARK_HOME is the package folder), for the tests and
`make dev-cluster`. The worker runs executors with this project's interpreter, so es_pipeline's code
(installed in the venv) needs no shipping; jars (Delta, S3A, JDBC) reach the executors through
`spark.jars` from the driver. Its environment (the AWS_* variables of an S3 lake among them) is the
executors'.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from es_pipeline.dev.stack import free_port, stop_process, wait_port
from es_pipeline.errors import LocalServerError
from es_pipeline.lake.spark.java import java_binary

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


@dataclass(frozen=True)
class SparkCluster:
    master_url: str  # spark://127.0.0.1:<port>
    web_ui: str  # the master's UI, whose /json/ lists the workers


def _daemon(env: dict[str, str], *args: str) -> None:
    import pyspark

    script = Path(pyspark.__file__).parent / "sbin" / "spark-daemon.sh"
    done = subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise LocalServerError(f"spark-daemon.sh {' '.join(args[:2])} failed: {(done.stderr or done.stdout).strip()}")


def _alive_workers(web_ui: str) -> int:
    with urllib.request.urlopen(f"{web_ui}/json/", timeout=5) as answer:  # noqa: S310 - the local master's UI
        return int(json.load(answer).get("aliveworkers", 0))


@contextmanager
def standalone(folder: Path, *, cores: int = 2, memory: str = "4g") -> Iterator[SparkCluster]:
    """A master and one worker on 127.0.0.1 for as long as the context lasts; logs under `folder`."""
    import pyspark

    if java_binary() is None:
        raise LocalServerError("a Spark cluster needs Java 17 or 21: a JDK on PATH or JAVA_HOME")
    folder.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "SPARK_MASTER"}  # spark-daemon.sh would rsync from it
    env.update({"SPARK_HOME": str(Path(pyspark.__file__).parent), "SPARK_LOG_DIR": str(folder / "logs"),
                "SPARK_PID_DIR": str(folder / "pids"), "SPARK_WORKER_DIR": str(folder / "work"),
                "SPARK_IDENT_STRING": f"es_pipeline-{os.getpid()}", "PYSPARK_PYTHON": sys.executable,
                "SPARK_DAEMON_MEMORY": "512m"})
    if os.environ.get("SPARK_SUBMIT_OPTS"):
        # The JVM options of the submitting side (the tests' short-lived JVMs: the client compiler, the serial
        # collector; Makefile) for every JVM of the cluster too: the master, the worker and the executors it starts
        # (a JVM reads JAVA_TOOL_OPTIONS from its environment; the worker's is its executors').
        env["JAVA_TOOL_OPTIONS"] = os.environ["SPARK_SUBMIT_OPTS"]
    port, ui_port, worker_ui = free_port(), free_port(), free_port()
    cluster = SparkCluster(f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{ui_port}")
    _daemon(env, "start", MASTER_CLASS, "1", "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui_port))
    try:
        wait_port(port, 60)
        _daemon(env, "start", WORKER_CLASS, "1", cluster.master_url, "--host", "127.0.0.1", "--cores", str(cores),
                "--memory", memory, "--work-dir", str(folder / "work"), "--webui-port", str(worker_ui))
        deadline = time.monotonic() + 60
        while _alive_workers(cluster.web_ui) < 1:
            if time.monotonic() > deadline:
                raise LocalServerError(f"the Spark worker did not register with {cluster.master_url}; see {folder}/logs")
            time.sleep(0.5)
        yield cluster
    finally:
        for cls in (WORKER_CLASS, MASTER_CLASS):
            try:
                _daemon(env, "stop", cls, "1")
            except LocalServerError:
                pass


@contextmanager
def connect_server(env: dict[str, str], log: Path, *, timeout: float = 180) -> Iterator[str]:
    """`es-pipeline spark serve` with `env` (its ES_PIPELINE_SPARK_MASTER names the cluster, its
    SPARK_CONNECT_AUTHENTICATE_TOKEN the token) for as long as the context lasts: the remote to attach to."""
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    cli = str(Path(sys.executable).parent / "es-pipeline")
    with log.open("wb") as out:
        server = subprocess.Popen([cli, "spark", "serve", "--port", str(port)], env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        try:
            wait_port(port, timeout)
        except TimeoutError:
            raise LocalServerError(f"the Spark Connect server did not listen within {timeout:.0f} s; see {log}") from None
        yield f"sc://localhost:{port}"
    finally:
        stop_process(server, 60)
