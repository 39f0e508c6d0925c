#!/usr/bin/env bash
# `make dev`: a Spark Connect server (one warm JVM shared by every run), the demo writers
# (--forever), `dagster dev` (UI + daemon, sensor on), the SQL endpoint (`es-pipeline sql-endpoint`), the health
# exporter (`es-pipeline metrics`) and, where
# Debian's `prometheus` is installed, a Prometheus server with es_pipeline's alert rules. Ctrl-C stops them all.
set -euo pipefail
# Job control on: without it bash starts background commands with SIGINT ignored, and Python
# programs (dagster dev among them) then cannot be interrupted the way Ctrl-C interrupts them.
set -m
cd "$(dirname "$0")/.."
pids=()
helpers=()  # the exporter and Prometheus: stopped with the rest, but their end does not end the loop
alive() { for p in "${pids[@]:-}" "${helpers[@]:-}"; do kill -0 -- "-$p" 2>/dev/null && return 0; done; return 1; }
cleanup() {
  trap - INT TERM EXIT
  echo "stopping: ${pids[*]:-}"
  # SIGINT first, as Ctrl-C: `dagster dev` shuts its webserver and daemon down only on that.
  # A run asked to stop ends as succeeded or canceled (es_pipeline/defs/stopping.py), not failed.
  for p in "${pids[@]:-}" "${helpers[@]:-}"; do kill -INT -- "-$p" 2>/dev/null || true; done
  for _ in $(seq 1 60); do alive || break; sleep 0.5; done
  for p in "${pids[@]:-}" "${helpers[@]:-}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  sleep 2
  for p in "${pids[@]:-}" "${helpers[@]:-}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup INT TERM EXIT

# The demo writers write made-up events: only into the project's own local server, never into an
# exported ES_PIPELINE_PG_DSN of another database (this refuses in one line before anything starts).
.venv/bin/es-pipeline demo load --check

port="${ES_PIPELINE_CONNECT_PORT:-15002}"
export ES_PIPELINE_SPARK_REMOTE="${ES_PIPELINE_SPARK_REMOTE:-sc://localhost:$port}"
# The server requires a token of every client (docs/security.md): the project's own unless one is exported.
export SPARK_CONNECT_AUTHENTICATE_TOKEN="${SPARK_CONNECT_AUTHENTICATE_TOKEN:-$(.venv/bin/python -c 'from es_pipeline.dev.connect_token import local_token; print(local_token())')}"
mkdir -p .dagster_home/logs
.venv/bin/es-pipeline spark serve --port "$port" > .dagster_home/logs/spark-connect.log 2>&1 &
pids+=($!)
echo "Spark Connect server starting on $ES_PIPELINE_SPARK_REMOTE (log: .dagster_home/logs/spark-connect.log)"
for _ in $(seq 1 120); do (echo > "/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.5; done

.venv/bin/es-pipeline demo load --forever --rate "${ES_PIPELINE_DEMO_RATE:-20}" --writers 4 --max-commit-delay 0.2 &
pids+=($!)
.venv/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p "${DAGSTER_PORT:-3000}" &
pids+=($!)
metrics_port="${ES_PIPELINE_METRICS_PORT:-9464}"
.venv/bin/es-pipeline metrics --port "$metrics_port" > .dagster_home/logs/metrics.log 2>&1 &
helpers+=($!)
echo "Health exporter: http://127.0.0.1:$metrics_port/metrics (log: .dagster_home/logs/metrics.log)"
if command -v prometheus >/dev/null 2>&1; then
  .venv/bin/python -m es_pipeline.health.prometheus --target "127.0.0.1:$metrics_port" \
    --port "${ES_PIPELINE_PROMETHEUS_PORT:-9090}" --folder .dagster_home/prometheus > .dagster_home/logs/prometheus.log 2>&1 &
  helpers+=($!)
  echo "Prometheus alerts: http://127.0.0.1:${ES_PIPELINE_PROMETHEUS_PORT:-9090}/alerts (es_pipeline's rules)"
fi
# The SQL endpoint: Spark's Thrift server on the catalog, for any JDBC/ODBC client (docs/analysts.md); localhost only.
sql_port="${ES_PIPELINE_SQL_PORT:-10000}"
.venv/bin/es-pipeline sql-endpoint --port "$sql_port" > .dagster_home/logs/sql-endpoint.log 2>&1 &
helpers+=($!)
echo "SQL endpoint: jdbc:hive2://127.0.0.1:$sql_port/es (up in about 30 s; log: .dagster_home/logs/sql-endpoint.log)"
echo "Dagster UI: http://127.0.0.1:${DAGSTER_PORT:-3000}  (Ctrl-C stops everything)"
wait -n "${pids[@]}"
