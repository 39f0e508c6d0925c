#!/usr/bin/env bash
# `make dev`: a Spark Connect server (one warm JVM shared by every run), the demo writers
# (--forever) and `dagster dev` (UI + daemon, sensor on). Ctrl-C stops them all.
set -euo pipefail
# Job control on: without it bash starts background commands with SIGINT ignored, and Python
# programs (dagster dev among them) then cannot be interrupted the way Ctrl-C interrupts them.
set -m
cd "$(dirname "$0")/.."
pids=()
alive() { for p in "${pids[@]:-}"; do kill -0 -- "-$p" 2>/dev/null && return 0; done; return 1; }
cleanup() {
  trap - INT TERM EXIT
  echo "stopping: ${pids[*]:-}"
  # SIGINT first, as Ctrl-C: `dagster dev` shuts its webserver and daemon down only on that.
  for p in "${pids[@]:-}"; do kill -INT -- "-$p" 2>/dev/null || true; done
  for _ in $(seq 1 60); do alive || break; sleep 0.5; done
  for p in "${pids[@]:-}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  sleep 2
  for p in "${pids[@]:-}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
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
echo "Dagster UI: http://127.0.0.1:${DAGSTER_PORT:-3000}  (Ctrl-C stops everything)"
wait -n "${pids[@]}"
