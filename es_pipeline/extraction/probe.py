"""What the sensor asks Postgres, and how it decides (pure). No Dagster here.

The probe answers: which slices have a committed event with `W(slice) <= tx_id < H`? Its cost must not
grow with the table, so it reads the *tail* (one statement in the steady state, a second only for step 3):

1. the newest events, `lo <= tx_id < H` with `lo` the lowest watermark, from the end of the index
   on the transaction order (`events_tx_order_idx`), at most `tail_rows` of them (one index descent
   plus the rows read);
2. a slice with a tail event at or above its own watermark is ready, and so is one whose first run since a
   rebase is still to come (`es_pipeline.rebase_catchup`);
3. if the tail was cut short at `tx_id = t`, the slices whose watermark is at or below `t` are not
   fully covered by it: each of them gets its own index probe on `(slice, tx_id)` (the old,
   1024-probe plan, now only for lagging slices, e.g. before the first run of a range).

In the steady state (every range extracted recently) the tail holds the events since the last runs,
a handful, and no slice needs its own probe. docs/decisions.md, "The sensor's probe", has the numbers.

The first statement reads `es_pipeline.offsets` beside the events, so that the horizon, the watermarks and
the tail are seen in one snapshot; the per-slice probes of step 3, when needed, are a second statement.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from es_pipeline.extraction.slices import NUM_SLICES, SliceRange
from es_pipeline.source.mapping import Source, as_source

# More new events than this since the lowest watermark, and the lagging slices are probed one by one.
TAIL_ROWS = 512


@dataclass(frozen=True)
class Probe:
    horizon: int
    ready_slices: frozenset[int]


_TAIL = """
WITH h AS MATERIALIZED (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS h),
     -- The lowest watermark; a slice without an offset row has watermark 0. Transaction ids are compared
     -- as bigints where aggregated (min/max over xid8 exist only from PostgreSQL 15; xid8 fits a bigint).
     lo AS MATERIALIZED (
         SELECT CASE WHEN count(*) = {slices} THEN min(watermark::text::bigint) ELSE 0 END AS lo
         FROM es_pipeline.offsets WHERE consumer = {consumer}),
     -- tx_id::text::bigint is the expression events_tx_order_idx indexes.
     tail AS MATERIALIZED (
         SELECT e.slice, e.tx_id::text::bigint AS tx FROM {events} e
         WHERE e.tx_id::text::bigint >= (SELECT lo FROM lo)
           AND e.tx_id::text::bigint < (SELECT h::text::bigint FROM h)
         ORDER BY e.tx_id::text::bigint DESC LIMIT {tail_rows}),
     from_tail AS MATERIALIZED (
         SELECT t.slice FROM (SELECT slice, max(tx) AS top FROM tail GROUP BY slice) t
         LEFT JOIN es_pipeline.offsets o ON o.consumer = {consumer} AND o.slice = t.slice
         WHERE t.top >= coalesce(o.watermark::text::bigint, 0)
         -- A slice whose first run since a rebase is to come is ready, new events or not: that run brings the
         -- restored events above the horizon (extraction/rebase.py), which no probe below the horizon sees.
         UNION SELECT slice FROM es_pipeline.rebase_catchup WHERE consumer = {consumer})
SELECT (SELECT h::text::bigint FROM h),
       -- NULL when the tail holds every event in [lo, H); else its lowest tx, which it may hold only in part.
       (SELECT CASE WHEN count(*) = {tail_rows} THEN min(tx) END FROM tail),
       (SELECT array_agg(slice) FROM from_tail)
"""

# Only when the tail was cut: each slice it does not cover, probed on (slice, tx_id) at the same horizon.
_LAGGING = """
SELECT array_agg(g.slice)
FROM generate_series(0, {last_slice}) AS g(slice)
LEFT JOIN es_pipeline.offsets o ON o.consumer = {consumer} AND o.slice = g.slice
WHERE coalesce(o.watermark::text::bigint, 0) <= {cut}
  AND g.slice <> ALL({covered})
  AND EXISTS (SELECT 1 FROM {events} e WHERE e.slice = g.slice
              AND e.tx_id >= coalesce(o.watermark, '0'::xid8) AND e.tx_id < {horizon}::text::xid8)
"""


def probe_statement(source: Source | str, tail_rows: int = TAIL_ROWS) -> sql.Composed:
    """The probe's statement for the steady state (the tail); its parameter is `consumer`."""
    if tail_rows < 1:
        raise ValueError(f"tail_rows must be at least 1, not {tail_rows}")
    return sql.SQL(_TAIL).format(
        slices=sql.Literal(NUM_SLICES),
        consumer=sql.Placeholder("consumer"),
        events=as_source(source).relation_sql(),
        tail_rows=sql.Literal(tail_rows),
    )


def lagging_statement(source: Source | str) -> sql.Composed:
    """The per-slice probe of the slices a cut tail does not cover; parameters `consumer`, `cut`, `covered`, `horizon`."""
    return sql.SQL(_LAGGING).format(
        last_slice=sql.Literal(NUM_SLICES - 1), consumer=sql.Placeholder("consumer"), cut=sql.Placeholder("cut"),
        covered=sql.SQL("{}::int[]").format(sql.Placeholder("covered")), horizon=sql.Placeholder("horizon"),
        events=as_source(source).relation_sql(),
    )


def probe(conn: psycopg.Connection, source: Source | str, consumer: str, *, tail_rows: int = TAIL_ROWS) -> Probe:
    """The horizon, and the slices with committed events at or above their watermark below it.

    Two statements, the second only when the tail was cut: each names the events table once, and on a table
    of many partitions planning it costs more than running it (docs/decisions.md, "The sensor's probe"). The
    second reads the offsets again, a moment later: a watermark that moved meanwhile only drops a slice whose
    events a run has just taken, and the horizon is the first statement's."""
    row = conn.execute(probe_statement(source, tail_rows), {"consumer": consumer}).fetchone()
    assert row is not None
    horizon, cut, covered = int(row[0]), row[1], list(row[2] or ())
    ready = set(covered)
    if cut is not None:
        more = conn.execute(lagging_statement(source), {
            "consumer": consumer, "cut": int(cut), "covered": covered, "horizon": str(horizon)}).fetchone()
        ready.update(more[0] or () if more else ())
    return Probe(horizon, frozenset(ready))


@dataclass(frozen=True)
class Decision:
    requests: list[tuple[str, str]] = field(default_factory=list)  # (partition key, run key)
    cursor: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # range -> why no request

    def skip_reason(self) -> str:
        if not self.skipped:
            return "no committed events below the horizon beyond the watermarks"
        return "; ".join(f"{k}: {why}" for k, why in sorted(self.skipped.items()))


def decide(
    ranges: Sequence[SliceRange],
    found: Probe,
    cursor: Mapping[str, int],
    queued: Iterable[str] = (),
    failed: Mapping[str, tuple[int, str]] = {},  # noqa: B006 - read only
) -> Decision:
    """One run request per range with new committed events, unless one is already waiting.

    - The probe (watermarks in Postgres) is the truth; the cursor only remembers the horizon last
      asked for per range, so a tick does not ask twice for the same horizon. A lost cursor asks
      again, and the run finds exactly what is left; a stale one cannot hide events, because any
      horizon other than the remembered one is asked for.
    - A range whose run is still queued (not started, so it has not read H yet) gets no second
      request: that run will see these events. So a backlog of ticks queues at most one run per range.
    - A range whose last run failed at this very horizon (`failed`: range -> (horizon, run id)) is asked
      again, under a run key naming that run (the plain one is used, and Dagster runs a key once): in a
      quiet store the horizon does not move, and its committed events would otherwise wait for ever.
    """
    waiting = set(queued)
    new_cursor = dict(cursor)
    decision = Decision(cursor=new_cursor)
    for r in ranges:
        if not any(s in found.ready_slices for s in r.slices):
            continue
        if r.key in waiting:
            decision.skipped[r.key] = "a run is already queued"
        elif failed.get(r.key, (None, ""))[0] == found.horizon:
            decision.requests.append((r.key, retry_key(f"{r.key}:{found.horizon}", failed[r.key][1])))
            new_cursor[r.key] = found.horizon
        elif cursor.get(r.key) == found.horizon:
            decision.skipped[r.key] = f"already requested at horizon {found.horizon}"
        else:
            decision.requests.append((r.key, f"{r.key}:{found.horizon}"))
            new_cursor[r.key] = found.horizon
    return decision


def retry_key(run_key: str, failed_run_id: str) -> str:
    """The run key that asks again after the run `failed_run_id` failed at the same horizon."""
    return f"{run_key}:after-{failed_run_id[:8]}"


def parse_cursor(text: str | None) -> dict[str, int]:
    """The sensor cursor is a hint: anything unreadable counts as empty."""
    if not text:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): int(v) for k, v in data.items() if isinstance(v, int)}


def format_cursor(cursor: Mapping[str, int]) -> str:
    return json.dumps(dict(sorted(cursor.items())), separators=(",", ":"))
