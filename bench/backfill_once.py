"""One backfill in a process of its own, for clean peak-memory figures (used by extract_memory).

    python -m bench.backfill_once --dsn DSN --warehouse DIR --events N

With the default writer (delta-rs) no Spark session is started, as in an `events` run; with
`--writer spark` es_pipeline's Spark session (local[2]) is. Runs `Extractor.run` over all 1024 slices of a
database already loaded with N events, and prints one line `BENCH_RESULT {json}` on stdout: the
Python process's VmHWM, the sampled peak RSS of the Spark JVM and of the other children, and times.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from bench.common import ALL_SLICES, SCHEMA, spark_session
from bench.procmem import ChildrenSampler, status_kib
from es_pipeline.extraction.extractor import Extractor

RESULT_PREFIX = "BENCH_RESULT "
log = logging.getLogger("bench.backfill_once")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.backfill_once", description="One backfill in a process of its own, for peak memory.")
    parser.add_argument("--dsn", required=True, help="a database loaded with the events (not changed but offsets)")
    parser.add_argument("--warehouse", required=True, type=Path, help="a fresh folder for the lake")
    parser.add_argument("--events", required=True, type=int, help="events expected in the backfill (checked)")
    parser.add_argument("--writer", default="delta-rs", choices=["delta-rs", "spark"], help="who writes to Delta")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")

    sampler = ChildrenSampler().start()
    t0 = time.perf_counter()
    spark = spark_session(args.warehouse) if args.writer == "spark" else None
    t1 = time.perf_counter()
    result = Extractor(args.dsn, spark, args.warehouse / "lake", schema=SCHEMA, progress=log.info,
                       writer=args.writer).run(
        ALL_SLICES, run_id="bench-memory"
    )
    t2 = time.perf_counter()
    peaks = sampler.stop()
    python_hwm = status_kib(os.getpid(), "VmHWM")
    if result.rows != args.events:
        raise SystemExit(f"backfill moved {result.rows:,} events, expected {args.events:,}")
    out = {
        "events": result.rows,
        "batches": result.batches,
        "spark_start_seconds": round(t1 - t0, 3),
        "backfill_seconds": round(t2 - t1, 3),
        "python_hwm_bytes": python_hwm * 1024,
        "jvm_peak_rss_bytes": peaks.jvm_kib * 1024,
        "other_children_peak_rss_bytes": peaks.others_kib * 1024,
        "other_children_at_peak": peaks.others_names,
        "children_peak_rss_bytes": peaks.children_kib * 1024,
        "total_peak_bytes": (python_hwm + peaks.children_kib) * 1024,
        "samples": peaks.samples,
    }
    print(RESULT_PREFIX + json.dumps(out), flush=True)
    if spark is not None:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
