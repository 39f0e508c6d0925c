"""The benchmarks of the real extraction and projection paths: `python -m bench.run [--quick] [--only NAME ...] [--keep]`.

Each benchmark writes `bench/results/<name>.json` (raw figures) and `<name>.md` (a table), its
figures expressed as ratios against a baseline measured in the same run. Sizes: defaults, or
smaller ones with `--quick`; BENCH_EVENTS, BENCH_SMALL and BENCH_LARGE override both. Data goes to
a throwaway database (BENCH_DB, default bench_es, dropped and recreated) and bench/work/.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from typing import Any

from bench import (
    event_tables,
    extract_backfill,
    extract_incremental,
    extract_memory,
    history,
    rebuild,
    small_store,
    state,
    table_memory,
)
from bench.common import WORK_ROOT, Sizes, database_name, drop_database, fresh_database, log, spark_session
from bench.jdbc import jdbc_jar
from bench.results import Goal, machine_facts, write_result

BENCHMARKS = (extract_backfill.NAME, extract_incremental.NAME, extract_memory.NAME, state.INCREMENTAL, state.REBUILD,
              event_tables.NAME, small_store.NAME, table_memory.NAME, history.NAME, rebuild.NAME)
OPTIONAL = (table_memory.LARGE,)  # run only when named with --only (long: 50M events)


class LazySpark:
    """The bench process's one Spark session (with the JDBC driver), started when first needed."""

    def __init__(self) -> None:
        self._spark: Any = None

    def get(self) -> Any:
        if self._spark is None:
            log.info("starting Spark (local[2]) with the Delta jars and the PostgreSQL JDBC driver")
            self._spark = spark_session(WORK_ROOT / "spark", extra_jars=[jdbc_jar()])
        return self._spark

    def stop(self) -> None:
        if self._spark is not None:
            self._spark.stop()
            self._spark = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description="es_pipeline's extraction benchmarks")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes: 200k events for the backfill and memory runs, 100k vs 1M for increments")
    parser.add_argument("--only", action="append", choices=(*BENCHMARKS, *OPTIONAL), metavar="NAME",
                        help=f"run only this benchmark (repeatable): {', '.join((*BENCHMARKS, *OPTIONAL))} (the last only when named)")
    parser.add_argument("--keep", action="store_true", help="keep the database and bench/work/ afterwards")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    sizes = Sizes.resolve(quick=args.quick)
    db = database_name()
    selected = [b for b in (*BENCHMARKS, *OPTIONAL) if (b in args.only if args.only else b in BENCHMARKS)]
    log.info("benchmarks %s, sizes %s, database %s", ", ".join(selected), sizes, db)

    shutil.rmtree(WORK_ROOT, ignore_errors=True)  # scratch of earlier runs
    WORK_ROOT.mkdir(parents=True)
    spark = LazySpark()
    goals: list[tuple[str, Goal]] = []
    started = time.perf_counter()
    try:
        for name in selected:
            facts = machine_facts()
            work = WORK_ROOT / name
            t0 = time.perf_counter()
            try:
                if name == extract_memory.NAME:
                    out = extract_memory.run(lambda: fresh_database(db), work, sizes)
                elif name == extract_backfill.NAME:
                    out = extract_backfill.run(fresh_database(db), spark.get(), work, sizes)
                elif name == state.INCREMENTAL:
                    out = state.run_incremental(fresh_database(db), spark.get(), work, sizes)
                elif name == state.REBUILD:
                    out = state.run_rebuild(fresh_database(db), spark.get(), work, sizes)
                elif name == event_tables.NAME:
                    out = event_tables.run(fresh_database(db), work, sizes)
                elif name == table_memory.LARGE:
                    out = table_memory.run_large(lambda: fresh_database(db), work,
                                                 int(os.environ.get("BENCH_HUGE", table_memory.LARGE_EVENTS)))
                elif name == table_memory.NAME:
                    out = table_memory.run(lambda: fresh_database(db), work, sizes)
                elif name == history.NAME:
                    out = history.run(fresh_database(db), work, sizes)
                elif name == rebuild.NAME:
                    out = rebuild.run(fresh_database(db), work, sizes)
                elif name == small_store.NAME:
                    out = small_store.run(fresh_database(db), work)
                else:
                    out = extract_incremental.run(fresh_database(db), spark.get(), work, sizes)
            finally:
                if not args.keep:
                    drop_database(db)
                    shutil.rmtree(work, ignore_errors=True)
            out["parameters"]["benchmark_seconds"] = round(time.perf_counter() - t0, 1)
            write_result(name, facts=facts, **out)
            goals += [(name, g) for g in out["goals"]]
    finally:
        spark.stop()
        if not args.keep:
            shutil.rmtree(WORK_ROOT, ignore_errors=True)
    print(f"\nall done in {time.perf_counter() - started:,.0f} s; results in bench/results/")
    for name, g in goals:
        print(f"  {name}: {g.describe().replace('**', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
