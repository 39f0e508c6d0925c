#!/usr/bin/env bash
# `make dev`: the demo writers (--forever) and `dagster dev` (UI + daemon), stopped together by Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
pids=()
cleanup() {
  trap - INT TERM EXIT
  echo "stopping: ${pids[*]:-}"
  for p in "${pids[@]:-}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup INT TERM EXIT

.venv/bin/es-pipeline demo load --forever --rate "${ES_PIPELINE_DEMO_RATE:-20}" --writers 4 --max-commit-delay 0.2 &
pids+=($!)
.venv/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p "${DAGSTER_PORT:-3000}" &
pids+=($!)
echo "Dagster UI: http://127.0.0.1:${DAGSTER_PORT:-3000}  (Ctrl-C stops everything)"
wait -n "${pids[@]}"
