"""s3_lake: the lake on S3 vs a local folder, the same extraction path (Arrow into delta-rs).

`python -m bench.s3_lake [--quick]`: a backfill of BENCH_EVENTS (default 5,000,000; `--quick` 500,000)
events from one store into a local lake and into a lake on a real S3 server (s3proxy 4.1.0 on this
machine, its filesystem store), then 1,000-event increments (5 of each). Baseline: the local lake, in
the same run; the figures are S3 / local. Where the time goes: the runs' own read and write seconds.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import time
from typing import Any

from bench.common import (
    ALL_SLICES,
    EVENTS_PER_STREAM,
    WORK_ROOT,
    database_name,
    fresh_database,
    load_events,
    log,
)
from bench.common import wait_until_extractable as extractable
from bench.extract_incremental import append_increment
from bench.results import Goal, machine_facts, n, ratio, secs, write_result
from es_pipeline.dev.s3proxy import s3proxy
from es_pipeline.extraction.extractor import Extractor, ExtractResult
from es_pipeline.lake.delta import tables

NAME = "s3_lake"
TITLE = "the lake on S3 (s3proxy) vs a local folder: backfill and increments"
INCREMENT, REPEATS = 1_000, 5


def _timed(extractor: Extractor, run_id: str) -> tuple[float, ExtractResult]:
    t0 = time.perf_counter()
    result = extractor.run(ALL_SLICES, run_id=run_id)
    return time.perf_counter() - t0, result


def _lake_bytes(location: str) -> int:
    fs, root = tables.filesystem(location)
    from pyarrow.fs import FileSelector

    return sum(f.size or 0 for f in fs.get_file_info(FileSelector(root, recursive=True)))


def run(events: int) -> dict[str, Any]:
    work = WORK_ROOT / NAME
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    with s3proxy(work / "s3") as s3:
        os.environ.update(s3.client_env())
        lakes = {"local": str(work / "local"), "S3": f"{s3.bucket('lake')}/bench"}
        dsn = fresh_database(database_name())
        log.info("[%s] loading %s events", NAME, f"{events:,}")
        load_seconds = load_events(dsn, events, max(1, events // EVENTS_PER_STREAM))
        extractable(dsn)
        backfill: dict[str, tuple[float, ExtractResult]] = {}
        for label, lake in lakes.items():
            # Separate consumers' offsets: the same store, extracted into each lake from the start.
            backfill[label] = _timed(Extractor(dsn, None, lake, consumer=f"bench:{label}"), f"bench-s3-backfill-{label}")
            log.info("[%s] backfill into %s: %.1f s", NAME, label, backfill[label][0])
        increments: dict[str, list[float]] = {label: [] for label in lakes}
        for i in range(REPEATS):
            append_increment(dsn, 900 + i, INCREMENT)
            extractable(dsn)
            for label, lake in lakes.items():
                seconds, result = _timed(Extractor(dsn, None, lake, consumer=f"bench:{label}"), f"bench-s3-inc-{label}-{i}")
                assert result.rows == INCREMENT, (label, result.rows)
                increments[label].append(seconds)
        sizes = {label: _lake_bytes(lake) for label, lake in lakes.items()}

    local_s, s3_s = backfill["local"][0], backfill["S3"][0]
    med = {label: statistics.median(ts) for label, ts in increments.items()}
    rows = []
    for label in lakes:
        seconds, result = backfill[label]
        rows.append([label + (" ← baseline" if label == "local" else ""), n(result.rows), secs(seconds),
                     n(result.rows / seconds), secs(result.read_seconds), secs(result.write_seconds),
                     ratio(seconds / local_s), secs(med[label]), ratio(med[label] / med["local"]),
                     f"{sizes[label] / 2**20:,.0f}"])
    return {
        "parameters": {"events": events, "increment": INCREMENT, "repeats": REPEATS, "writer": "delta-rs",
                       "s3_server": "s3proxy 4.1.0 (filesystem store), same machine"},
        "columns": ["lake", "backfill events", "backfill s", "events/s", "read s", "write s", "backfill ratio",
                    "increment median s", "increment ratio", "lake MiB"],
        "rows": rows,
        "figures": {
            "load_seconds": round(load_seconds, 2),
            "backfill_seconds": {k: round(v[0], 3) for k, v in backfill.items()},
            "backfill_read_seconds": {k: round(v[1].read_seconds, 3) for k, v in backfill.items()},
            "backfill_write_seconds": {k: round(v[1].write_seconds, 3) for k, v in backfill.items()},
            "increment_seconds": {k: [round(s, 4) for s in v] for k, v in increments.items()},
            "ratio_backfill_s3_to_local": round(s3_s / local_s, 4),
            "ratio_increment_s3_to_local": round(med["S3"] / med["local"], 4),
            "lake_bytes": sizes,
        },
        "goals": [Goal("backfill S3 / local", s3_s / local_s, "<=", 1.5),
                  Goal("increment S3 / local", med["S3"] / med["local"], "<=", 2.0)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.s3_lake", description=TITLE)
    parser.add_argument("--quick", action="store_true", help="500,000 events instead of 5,000,000")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    events = int(os.environ.get("BENCH_EVENTS", "500000" if args.quick else "5000000"))
    facts = machine_facts()
    out = run(events)
    write_result(NAME, title=TITLE, facts=facts, parameters=out["parameters"], columns=out["columns"],
                 rows=out["rows"], figures=out["figures"], goals=out["goals"],
                 notes=["Both lakes are filled by the same path (Arrow through the driver into delta-rs). The S3 "
                        "server runs on this machine, so the ratio is the cost of the S3 protocol (requests, "
                        "signing, put-if-absent commits), not of a network."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
