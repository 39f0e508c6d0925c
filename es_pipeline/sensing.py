"""What the sensor asks Postgres, and how it decides (pure). No Dagster here.

The probe is one statement: for each of the 1024 slices, does an event exist with
`W(slice) <= tx_id < H`? Each EXISTS is one index probe on (slice, tx_id), so a tick costs the
same with a thousand events or a billion.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from es_pipeline.slices import NUM_SLICES, SliceRange


@dataclass(frozen=True)
class Probe:
    horizon: int
    ready_slices: frozenset[int]


def probe(conn: psycopg.Connection, schema: str, consumer: str) -> Probe:
    row = conn.execute(
        sql.SQL(
            "WITH h AS MATERIALIZED (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS h), "
            "w AS (SELECT g.slice::smallint AS slice, coalesce(o.watermark, '0'::xid8) AS wm "
            "      FROM generate_series(0, %s) AS g(slice) "
            "      LEFT JOIN es_pipeline.offsets o ON o.consumer = %s AND o.slice = g.slice) "
            "SELECT (SELECT h::text::bigint FROM h), "
            "       (SELECT array_agg(w.slice) FROM w, h WHERE EXISTS ("
            "           SELECT 1 FROM {}.events e WHERE e.slice = w.slice AND e.tx_id >= w.wm AND e.tx_id < h.h))"
        ).format(sql.Identifier(schema)),
        (NUM_SLICES - 1, consumer),
    ).fetchone()
    assert row is not None
    return Probe(int(row[0]), frozenset(row[1] or ()))


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
) -> Decision:
    """One run request per range with new committed events, unless one is already waiting.

    - The probe (watermarks in Postgres) is the truth; the cursor only remembers the horizon last
      asked for per range, so a tick does not ask twice for the same horizon. A lost cursor asks
      again, and the run finds exactly what is left; a stale one cannot hide events, because any
      horizon other than the remembered one is asked for.
    - A range whose run is still queued (not started, so it has not read H yet) gets no second
      request: that run will see these events. So a backlog of ticks queues at most one run per range.
    """
    waiting = set(queued)
    new_cursor = dict(cursor)
    decision = Decision(cursor=new_cursor)
    for r in ranges:
        if not any(s in found.ready_slices for s in r.slices):
            continue
        if r.key in waiting:
            decision.skipped[r.key] = "a run is already queued"
        elif cursor.get(r.key) == found.horizon:
            decision.skipped[r.key] = f"already requested at horizon {found.horizon}"
        else:
            decision.requests.append((r.key, f"{r.key}:{found.horizon}"))
            new_cursor[r.key] = found.horizon
    return decision


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
