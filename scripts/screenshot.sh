#!/usr/bin/env bash
# docs/asset-graph.png: the global asset graph of a running Dagster UI, taken by headless Chromium.
#   make dev            # in another terminal, until the UI answers
#   bash scripts/screenshot.sh [http://127.0.0.1:3000]
# Needs a Chromium (Debian: apt-get install -y chromium); not part of the test run.
set -euo pipefail
cd "$(dirname "$0")/.."
base="${1:-http://127.0.0.1:${DAGSTER_PORT:-3000}}"
browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
[ -n "$browser" ] || { echo "no Chromium found: apt-get install -y chromium" >&2; exit 2; }
curl -fsS "$base/server_info" >/dev/null || { echo "no Dagster UI answers at $base: start make dev first" >&2; exit 2; }
# The first visit to a fresh instance shows a "join the community" dialog: mark it seen, as a click would.
curl -fsS -X POST -H 'Content-Type: application/json' -d '{"query":"mutation { setNuxSeen }"}' "$base/graphql" >/dev/null
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1600,900 \
  --virtual-time-budget=25000 --screenshot="$PWD/docs/asset-graph.png" "$base/asset-groups"
echo "wrote docs/asset-graph.png"
