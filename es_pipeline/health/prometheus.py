"""A real Prometheus server (Debian's `prometheus` package) scraping `es-pipeline metrics` with es_pipeline's alert
rules: `make dev` starts one beside the exporter (its alerts at http://127.0.0.1:9090/alerts), and the health
drills (es_pipeline_tests/e2e/test_health_drills.py) watch its alerts fire and resolve.

`python -m es_pipeline.health.prometheus --target 127.0.0.1:9464 [--port 9090]` runs one until stopped.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from es_pipeline.health.exporter import ALERTS

JOB = "es_pipeline"  # the scrape job's name: the alert EsPipelineExporterDown watches `up{job="es_pipeline"}`


def binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        raise FileNotFoundError("no `prometheus` on PATH: `apt-get install prometheus` (Debian), or see "
                                "docs/operations.md for running es_pipeline's rules on your own Prometheus")
    return found


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]

    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as r:
            return json.loads(r.read())["data"]

    def alerts(self) -> list[dict[str, Any]]:
        """Every alert pending or firing now: {labels, annotations, state, activeAt, value}."""
        return list(self._get("/api/v1/alerts")["alerts"])

    def firing(self, name: str) -> list[dict[str, Any]]:
        return [a for a in self.alerts() if a["labels"].get("alertname") == name and a["state"] == "firing"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))["result"])


def config(targets: list[str], interval: str, rules: Path) -> str:
    return (f"global:\n  scrape_interval: {interval}\n  evaluation_interval: {interval}\n"
            f"rule_files:\n  - {rules}\n"
            f"scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: {json.dumps(targets)}\n")


@contextmanager
def prometheus(targets: list[str], folder: Path, *, port: int, interval: str = "10s",
               rules: Path = ALERTS) -> Iterator[Prometheus]:
    """A Prometheus server on 127.0.0.1:`port` scraping `targets` every `interval` and evaluating `rules` as often,
    its data and log in `folder`; stopped (TERM, then KILL) on exit."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prometheus.yml").write_text(config(targets, interval, rules))
    log = open(folder / "prometheus.log", "wb")  # noqa: SIM115 - the server's, closed below
    process = subprocess.Popen(
        [binary(), f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Prometheus(f"http://127.0.0.1:{port}", process)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Prometheus did not start: {(folder / 'prometheus.log').read_text()[-2000:]}") from None
                time.sleep(0.3)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m es_pipeline.health.prometheus", description=__doc__)
    p.add_argument("--target", action="append", default=None, help="host:port of an exporter (default 127.0.0.1:9464)")
    p.add_argument("--port", type=int, default=9090)
    p.add_argument("--interval", default="10s")
    p.add_argument("--folder", type=Path, default=None, help="data and log (default: a temporary folder)")
    args = p.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="es_pipeline_prometheus_") as tmp, \
            prometheus(args.target or ["127.0.0.1:9464"], args.folder or Path(tmp), port=args.port,
                       interval=args.interval) as server:
        print(f"Prometheus: {server.url}/alerts (es_pipeline's rules; Ctrl-C stops)", flush=True)
        while not stop.is_set() and server.process.poll() is None:
            stop.wait(1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
