"""Declared folds against the Python fold of the same state (issue 65, es_pipeline/declared.py).

A lake of `BENCH_EVENTS` account events (default 5,000,000 over 100,000 streams: an Opened, deposits and withdrawals,
a Closed for one in ten) written straight into `events` by delta-rs, in the extractor's schema and as it commits (a
commit of one file per 500,000 events, its default batch), so that the measurement is the fold and nothing else. Then `stream_state`'s first build, in process, three times each:
- the Python fold: the summary written as a Python reducer (exact decimals), every event through it, one forked
  process per core (lake/state/whole_fold.py) ← baseline;
- the declared fold: the same summary declared (`shop.summary`'s fields), built by DuckDB's aggregation
  (lake/state/declared_build.py).
Both builds must give the same states, or the benchmark fails. Then an increment: 1,000 new events in one commit,
folded onto each built table (the small increment, the same for both: the declaration's Python fold), best of 3.
A plain DuckDB `GROUP BY` (count, max version) over the same `events` version is shown for scale.

Then the same on Spark (BENCH_DECLARED_SPARK=0 leaves it out, as the smoke run does): the declared build by Spark's
aggregation against a `groupBy` of the same state over the same parsed columns, and once the Python fold on Spark's
workers.

Figures: seconds, events/s, and ratios to the Python fold (`declared_fold.json`, `declared_fold.md`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake
from shop.summary import ACCOUNT_FIELDS

from bench.common import WORK_ROOT, spark_session
from bench.results import Goal, machine_facts, n, ratio, secs, write_result
from es_pipeline.domain import Domain, Event, State
from es_pipeline.lake.events import EVENTS
from es_pipeline.lake.kernel.engine import Engine
from es_pipeline.lake.state.stream_state import update_stream_state
from es_pipeline.settings import DEFAULT_BATCH_EVENTS

NAME = "declared_fold"
WORK = WORK_ROOT / "declared_fold"
EVENTS_N = int(os.environ.get("BENCH_EVENTS", "5000000"))
PER_STREAM = 50
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
INCREMENT = 1_000
SPARK = os.environ.get("BENCH_DECLARED_SPARK", "1") == "1"  # the smoke run leaves Spark out (its tests cover it)
LOCAL = Engine("local")
CENT = Decimal("0.01")

DECLARED = Domain("bench, declared")
DECLARED.declare("account", revision=1, fields=ACCOUNT_FIELDS)  # shop.summary's, untyped
PYTHON = Domain("bench, python")


@PYTHON.reducer("account", revision=1)
def account(state: State, event: Event) -> State:
    s = {"balance": "0.00", "deposits": 0, "withdrawals": 0, **state}
    p, t = event.payload, event.event_type
    if t == "Opened":
        if s.get("owner") is None and p.get("owner") is not None:
            s["owner"] = p["owner"]
        if p.get("currency") is not None:
            s["currency"] = p["currency"]
        s["status"] = "open"
    elif t == "Closed":
        s["status"] = "closed"
    elif t in ("Deposited", "Withdrawn") and p.get("amount") is not None:
        amount = Decimal(str(p["amount"])).quantize(CENT)
        s["balance"] = str((Decimal(s["balance"]) + (amount if t == "Deposited" else -amount)).quantize(CENT))
        s["deposits" if t == "Deposited" else "withdrawals"] += 1
    return s


def _events(first_stream: int, streams: int, per_stream: int, first_version: int = 1, position: int = 0) -> pa.Table:
    """Account events in `events`' schema: stream i's versions first_version.. (an Opened at 1, a Closed last for
    one stream in ten, deposits and withdrawals between), made column by column."""
    ids = np.repeat(np.arange(first_stream, first_stream + streams, dtype=np.int64), per_stream)
    versions = np.tile(np.arange(first_version, first_version + per_stream, dtype=np.int64), streams)
    n = len(ids)
    opened = versions == 1
    closed = (versions == per_stream) & (ids % 10 == 0) & (first_version == 1)
    deposited = (ids + versions) % 3 != 0
    types = np.where(opened, "Opened", np.where(closed, "Closed", np.where(deposited, "Deposited", "Withdrawn")))
    amounts = pc.cast(pa.array(((ids * 7 + versions * 13) % 50_000) / 100), pa.string())
    owners = pc.cast(pa.array(ids % 9973), pa.string())
    payload = pc.if_else(pa.array(opened), pc.binary_join_element_wise('{"owner":"owner-', owners, '","currency":"EUR"}', ""),
                         pc.if_else(pa.array(closed), pa.scalar("{}"),
                                    pc.binary_join_element_wise('{"amount":', amounts, "}", "")))
    positions = np.arange(position + 1, position + n + 1, dtype=np.int64)
    columns = {
        "global_position": positions, "tx_id": positions,
        "stream_id": pc.binary_join_element_wise("acct-", pc.cast(pa.array(ids), pa.string()), ""),
        "stream_type": pa.array(["account"] * n), "version": versions.astype(np.int32),
        "slice": (ids % 1024).astype(np.int32), "event_type": pa.array(types), "payload": payload,
        "metadata": pa.array(["{}"] * n), "recorded_at": pa.array(1_790_000_000_000_000 + positions),
        "event_date": pa.array(np.full(n, 20_400, dtype=np.int32)), "batch_id": np.ones(n, dtype=np.int64),
        "payload_encoding": pa.array(["json"] * n), "tenant": pa.array([""] * n),
    }
    return pa.table({f.name: pa.array(columns[f.name]).cast(f.type) for f in EVENTS.schema}, schema=EVENTS.schema)


def _lake(warehouse: Path, events: int) -> int:
    streams = max(1, events // PER_STREAM)
    path = EVENTS.ensure_arrow(warehouse)
    step = max(1, DEFAULT_BATCH_EVENTS // PER_STREAM)  # a commit per extraction batch, as the extractor commits
    for start in range(0, streams, step):
        write_deltalake(path, _events(start, min(step, streams - start), PER_STREAM, position=start * PER_STREAM),
                        mode="append")
    return streams


def _fresh(warehouse: Path) -> None:
    for name in os.listdir(warehouse):
        if name != "events":
            shutil.rmtree(warehouse / name)


def _states(warehouse: Path) -> dict[str, Any]:
    import json

    rows = DeltaTable(str(warehouse / "stream_state")).to_pyarrow_table(columns=["stream_id", "version", "state"])
    return {sid: (v, json.loads(s)) for sid, v, s in zip(rows["stream_id"].to_pylist(), rows["version"].to_pylist(),
                                                          rows["state"].to_pylist(), strict=True)}


def _build(warehouse: Path, domain: Domain, engine: Engine = LOCAL) -> float:
    _fresh(warehouse)
    started = time.perf_counter()
    update_stream_state(engine, warehouse, domain=domain)
    return time.perf_counter() - started


def _on_spark(warehouse: Path, by_python: dict[str, Any]) -> dict[str, Any]:
    """The same first build on Spark (local[2]): the declared build (Spark's aggregation) against a `groupBy` stream
    of the same state over the same parsed columns (each payload parsed once as the build parses it, its fields taken
    alike), as one would write it by hand, without the checks that keep the build exact, written to a Delta table as
    the build writes its rows; for scale, a `groupBy` that only counts those columns; and, once, the Python fold on
    Spark's workers."""
    from pyspark.sql import functions as F

    from es_pipeline.lake.delta import tables
    from es_pipeline.lake.state import declared_spark

    spark = spark_session(WORK / "spark")
    group_by: list[float] = []
    counts: list[float] = []
    declared: list[float] = []
    queries: dict[str, list[float]] = {"group_by": [], "declared": []}
    reducer = DECLARED.folds["account"]

    def parsed() -> Any:
        return declared_spark.parsed(tables.read(spark, str(warehouse / "events")), reducer, "account")

    def grouped() -> Any:  # a groupBy stream over the build's parsed columns: the same state, as one would write it
        rows, t = parsed(), F.col("event_type")
        return rows.groupBy("tenant", "stream_id").agg(
            F.max("version").alias("version"), F.max_by("recorded_at", "version").alias("last_event_at"),
            F.count("*").alias("events"),
            F.sum(F.when(t == "Withdrawn", -F.col("d_0_2")).when(t == "Deposited", F.col("d_0_2"))).alias("balance"),
            F.count_if(t == "Deposited").alias("deposits"), F.count_if(t == "Withdrawn").alias("withdrawals"),
            F.max_by(F.when(t == "Opened", "open").when(t == "Closed", "closed"),
                     F.when(t.isin("Opened", "Closed"), F.col("version"))).alias("status"),
            F.max_by(F.variant_get("v_1", "$", "string"), F.when(F.col("v_1").isNotNull(), F.col("version")))
            .alias("currency"),
            F.min_by(F.variant_get("v_2", "$", "string"), F.when(F.col("v_2").isNotNull(), F.col("version")))
            .alias("owner"))

    def counted() -> Any:  # for scale: a count per stream and of each parsed column, no state
        rows = parsed()
        return rows.groupBy("tenant", "stream_id").agg(
            F.count("*").alias("events"), F.max("version").alias("version"),
            *[F.count(c).alias(f"n_{c}") for c in rows.columns if c.startswith(("v_", "a_"))])

    for _ in range(REPEATS):
        # The two queries alone, to Spark's noop sink: what the aggregation costs without the table's bookkeeping.
        native = declared_spark.build(tables.read(spark, str(warehouse / "events")), {"account": reducer})
        for label, frame in (("group_by", grouped()), ("declared", native.cached)):
            started = time.perf_counter()
            frame.write.format("noop").mode("overwrite").save()
            queries[label].append(time.perf_counter() - started)
        native.unpersist()
        started = time.perf_counter()
        grouped().write.format("delta").mode("overwrite").save(str(WORK / "group_by"))
        group_by.append(time.perf_counter() - started)
        started = time.perf_counter()
        counted().write.format("delta").mode("overwrite").save(str(WORK / "counted"))
        counts.append(time.perf_counter() - started)
        declared.append(_build(warehouse, DECLARED, Engine("spark", spark)))
        if _states(warehouse) != by_python:
            raise SystemExit("the declared build on Spark differs from the Python fold")
    python = _build(warehouse, PYTHON, Engine("spark", spark))  # once: minutes at 5M
    if _states(warehouse) != by_python:
        raise SystemExit("the Python fold on Spark differs from the Python fold in process")
    spark.stop()
    return {"group_by": group_by, "counted": counts, "declared": declared, "python": python, "queries": queries}


def main() -> int:
    warehouse = WORK / "lake"
    shutil.rmtree(WORK, ignore_errors=True)
    warehouse.mkdir(parents=True)
    t0 = time.perf_counter()
    streams = _lake(warehouse, EVENTS_N)
    events = streams * PER_STREAM
    print(f"{events:,} events of {streams:,} streams written in {time.perf_counter() - t0:.1f} s", flush=True)

    import duckdb

    con = duckdb.connect()
    con.register("events_now", DeltaTable(str(warehouse / "events")).to_pyarrow_dataset())
    group_by = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        con.execute("SELECT stream_id, count(*), max(version) FROM events_now GROUP BY stream_id").fetch_arrow_table()
        group_by.append(time.perf_counter() - started)
    con.close()

    python_s, declared_s = [], []
    for _ in range(REPEATS):
        python_s.append(_build(warehouse, PYTHON))
        by_python = _states(warehouse)
        declared_s.append(_build(warehouse, DECLARED))
        by_declaration = _states(warehouse)
        if by_declaration != by_python:
            differ = [k for k in by_python if by_python[k] != by_declaration.get(k)][:3]
            print(f"the declared build differs from the Python fold: {differ}", file=sys.stderr)
            return 1

    on_spark = _on_spark(warehouse, by_python) if SPARK else None

    base = WORK / "events_base"
    shutil.copytree(warehouse / "events", base)
    increments: dict[str, float] = {}
    for label, domain in (("python", PYTHON), ("declared", DECLARED)):
        shutil.rmtree(warehouse / "events")
        shutil.copytree(base, warehouse / "events")  # the same lake for each: the other's increments gone
        _build(warehouse, domain)
        best = float("inf")
        for r in range(REPEATS):  # 1,000 new events in one commit: 100 streams, 10 versions each
            write_deltalake(str(warehouse / "events"),
                            _events(0, INCREMENT // 10, 10, first_version=PER_STREAM + 1 + 10 * r,
                                    position=events + 10_000 * (r + 1)), mode="append")
            started = time.perf_counter()
            update_stream_state(Engine("local"), warehouse, domain=domain)
            best = min(best, time.perf_counter() - started)
        increments[label] = best

    python_best, declared_best, group_best = min(python_s), min(declared_s), min(group_by)
    speedup = python_best / declared_best
    rows = [
        ["stream_state first build, the Python fold (forked, one process per core) ← baseline", n(events),
         secs(python_best), n(events / python_best), ratio(1.0)],
        ["stream_state first build, declared (DuckDB aggregation, lake/state/declared_build.py)", n(events),
         secs(declared_best), n(events / declared_best), ratio(speedup)],
        ["for scale: DuckDB GROUP BY stream (count, max version) over the same events", n(events), secs(group_best),
         n(events / group_best), ratio(python_best / group_best)],
        ["increment: 1,000 events onto the Python fold's table (best of 3)", n(INCREMENT),
         secs(increments["python"]), n(INCREMENT / increments["python"]), "—"],
        ["increment: 1,000 events onto the declared table (best of 3)", n(INCREMENT),
         secs(increments["declared"]), n(INCREMENT / increments["declared"]),
         ratio(increments["python"] / increments["declared"])],
    ]
    goals = [Goal("declared first build / Python fold, speed-up", speedup, ">=", 10.0),
             Goal("declared increment / Python increment, speed-up", increments["python"] / increments["declared"],
                  ">=", 0.9)]
    if on_spark is not None:
        spark_group, spark_declared = min(on_spark["group_by"]), min(on_spark["declared"])
        rows += [
            ["on Spark: groupBy stream over the same parsed columns, the same state, written to Delta "
             "← Spark's baseline", n(events), secs(spark_group), n(events / spark_group), ratio(1.0)],
            ["on Spark, for scale: groupBy stream over the same parsed columns, counts only, written to Delta",
             n(events), secs(min(on_spark["counted"])), n(events / min(on_spark["counted"])),
             ratio(spark_group / min(on_spark["counted"]))],
            ["on Spark: stream_state first build, declared (Spark's aggregation, lake/state/declared_spark.py)",
             n(events), secs(spark_declared), n(events / spark_declared), ratio(spark_group / spark_declared)],
            ["on Spark, the query alone (to the noop sink): groupBy of the same state over the same parsed columns",
             n(events),
             secs(min(on_spark["queries"]["group_by"])), n(events / min(on_spark["queries"]["group_by"])), "—"],
            ["on Spark, the query alone (to the noop sink): the declared aggregation", n(events),
             secs(min(on_spark["queries"]["declared"])), n(events / min(on_spark["queries"]["declared"])),
             ratio(min(on_spark["queries"]["group_by"]) / min(on_spark["queries"]["declared"]))],
            ["on Spark: stream_state first build, the Python fold on Spark's workers (once)", n(events),
             secs(on_spark["python"]), n(events / on_spark["python"]), ratio(spark_group / on_spark["python"])],
        ]
        goals.append(Goal("on Spark: declared first build / groupBy of the same state over the same parsed columns",
                          spark_group / spark_declared, ">=", 0.8))
    write_result(
        NAME, title="stream_state's first build: a declared fold against the Python fold of the same state",
        facts=machine_facts(),
        parameters={"events": events, "streams": streams, "repeats": REPEATS, "cores": os.cpu_count()},
        columns=["measurement", "events", "seconds", "events/s", "ratio (speed-up over the Python fold)"],
        rows=rows,
        figures={"python_seconds": python_s, "declared_seconds": declared_s, "group_by_seconds": group_by,
                 "increment_seconds": increments, "speedup": speedup, "spark": on_spark},
        goals=goals,
        notes=["Both builds give the same state for every stream (checked each round). The declared build's streams "
               "are aggregated by DuckDB over the `events` version the build reads; the Python fold folds every event "
               "through the reducer in forked processes. An increment folds the new events by the declaration's own "
               "Python fold (the same path as any reducer's): it should cost the same.",
               "On Spark (local[2]), the baseline is a `groupBy` stream over the same parsed columns: each payload "
               "parsed once as the build parses it (`try_parse_json`), the same fields taken from the same event types, "
               "the same state computed as one would write it by hand (a signed sum, counts, the last status, the first "
               "owner, the last currency), without the checks that keep the declared build exact, written to a Delta "
               "table. For scale, a `groupBy` that only counts those columns (the baseline before 2026-11-29 (7)). "
               "The declared build is `update_stream_state` "
               "from nothing, Spark's aggregation, written as the table. The Python fold on Spark's workers is run "
               "once, for scale. Every Spark build gives the same states as the Python fold in process. The two queries "
               "alone (to Spark's noop sink, no table written) show what the aggregation costs without the table's "
               "bookkeeping and write."],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
