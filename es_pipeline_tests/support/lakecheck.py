"""Event-by-event comparison of the Delta `events` table with the event store."""

from __future__ import annotations

import datetime as dt
import decimal
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg

from es_pipeline.extraction.extractor import Extractor
from es_pipeline.lake.delta import tables

Key = tuple[str, int]


def extract_all(dsn: str, spark: Any, warehouse: tables.Location, n_ranges: int = 4, **kw: Any) -> int:
    """Extract every range once (ranges of `n_ranges`); returns the events moved."""
    from es_pipeline.extraction.slices import split

    ex = Extractor(dsn, spark, warehouse, **kw)
    return sum(ex.run(r).rows for r in split(n_ranges))


def extract_while(extractor: Extractor, busy: Callable[[], bool]) -> int:
    """Extract every slice over and over while `busy()` (writers still at work; at least once), then once more
    after; the runs made while busy."""
    from es_pipeline.extraction.slices import SliceRange

    runs = 0
    while busy() or runs == 0:
        extractor.run(SliceRange(0, 1023), run_id=f"run-{runs}")
        runs += 1
    extractor.run(SliceRange(0, 1023), run_id="final")
    return runs


def source_events(dsn: str, schema: str = "es") -> dict[Key, str]:
    """Every committed event: (stream_id, version) -> payload as JSON text."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(f"SELECT stream_id, version, payload::text FROM {schema}.events").fetchall()
    return {(s, v): p for s, v, p in rows}


def lake_events(spark: Any, warehouse: tables.Location) -> list[tuple[str, int, str]]:
    path = tables.table_path(warehouse, "events")
    rows = tables.read(spark, path).select("stream_id", "version", "payload").collect()
    return [(r["stream_id"], r["version"], r["payload"]) for r in rows]


def assert_exactly_once(spark: Any, warehouse: tables.Location, dsn: str) -> int:
    """The lake holds each committed event once, with the same payload; returns the count."""
    return _same_events(source_events(dsn), [((s, v), p) for s, v, p in lake_events(spark, warehouse)])


def assert_exactly_once_by_key(warehouse: tables.Location, dsn: str, source: Any = "es") -> int:
    """Without Spark: the lake holds each event of the store once, by (tenant, stream id, version), with the same
    payload; returns the count. Two tenants' streams of one id are two streams."""
    from deltalake import DeltaTable

    from es_pipeline.source.mapping import as_source

    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            f"SELECT coalesce(e.tenant, ''), e.stream_id, e.version, e.payload FROM {as_source(source).relation()} e"  # type: ignore[arg-type]
        ).fetchall()
    lake = DeltaTable(tables.table_path(warehouse, "events")).to_pyarrow_table(
        columns=["tenant", "stream_id", "version", "payload"])
    held = zip([t or "" for t in lake["tenant"].to_pylist()], lake["stream_id"].to_pylist(),
               lake["version"].to_pylist(), lake["payload"].to_pylist(), strict=True)
    return _same_events({(str(t), str(s), int(v)): p for t, s, v, p in rows}, [((t, s, v), p) for t, s, v, p in held])


def _same_events(expected: dict[Any, Any], rows: list[tuple[Any, Any]]) -> int:
    """Each key of `expected` once among the lake's (key, payload) `rows`, with its payload, and nothing else."""
    counts = Counter(k for k, _ in rows)
    duplicates = sorted(k for k, n in counts.items() if n > 1)
    assert not duplicates, f"{len(duplicates)} events duplicated in the lake, e.g. {duplicates[:3]}"
    got = dict(rows)
    missing = expected.keys() - got.keys()
    extra = got.keys() - expected.keys()
    assert not missing, f"{len(missing)} of {len(expected)} committed events missing from the lake, e.g. {sorted(missing)[:3]}"
    assert not extra, f"{len(extra)} events in the lake that the store does not hold, e.g. {sorted(extra)[:3]}"
    wrong = [k for k in expected if expected[k] != got[k]]
    assert not wrong, f"{len(wrong)} payloads differ, e.g. {wrong[:3]}"
    return len(expected)


def same_value(held: Any, value: Any) -> bool:
    """Whether a typed column's value holds a payload's (lake/typed/shapes.py undone): a number or boolean in a string
    column as its JSON text, a whole number in a double column as a float, a struct's fields the object's (others
    null). Exact: no digit lost."""
    if value is None:
        return held is None
    if isinstance(held, decimal.Decimal):  # a declared decimal, from a number or a string of one
        return held == decimal.Decimal(repr(value) if isinstance(value, float) else str(value))
    if isinstance(held, dt.datetime) and isinstance(value, str):  # a declared timestamp: without an offset, UTC
        at = dt.datetime.fromisoformat(value)
        return held == (at if at.tzinfo else at.replace(tzinfo=dt.UTC))
    if isinstance(held, dt.date) and isinstance(value, str):
        return held == dt.date.fromisoformat(value)
    if isinstance(held, list) and isinstance(value, dict):  # a declared map: (key, value) pairs
        return len(held) == len(value) and all(k in value and same_value(v, value[k]) for k, v in held)
    if isinstance(held, str) and not isinstance(value, str):
        return json.loads(held) == value
    if isinstance(value, dict):
        return isinstance(held, dict) and all(same_value(held.get(k), v) for k, v in value.items()) and \
            all(v is None for k, v in held.items() if k not in value)
    if isinstance(value, list):
        return isinstance(held, list) and len(held) == len(value) and all(map(same_value, held, value))
    return held == value and isinstance(held, bool) == isinstance(value, bool)


def events_checks(spark: Any, warehouse: tables.Location, dsn: str, source: Any = "es") -> dict[str, Any]:
    """The library's checks of `events` (es_pipeline/checks/events.py) over the whole table, by the engine rule with
    `spark` where it says Spark: each check's name and its `Outcome` (or the error it raised)."""
    from es_pipeline import checks
    from es_pipeline.lake.kernel.engine import Engine
    from es_pipeline.source.mapping import as_source

    given = checks.Given(Engine(spark=spark), warehouse, dsn, as_source(source))
    return checks.run(checks.events.CHECKS, given)


def assert_events_checks_pass(spark: Any, warehouse: tables.Location, dsn: str, source: Any = "es") -> None:
    for name, outcome in events_checks(spark, warehouse, dsn, source).items():
        assert not isinstance(outcome, Exception) and outcome.passed, (name, outcome)
