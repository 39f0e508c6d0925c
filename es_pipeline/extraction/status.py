"""`es-pipeline status`: per slice range, the watermarks, the horizon, the lag."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from es_pipeline.extraction import reader
from es_pipeline.extraction.offsets import OffsetSession, read_watermarks
from es_pipeline.extraction.slices import SliceRange, split
from es_pipeline.lake.delta import erase as lake_erase
from es_pipeline.lake.events import EVENTS
from es_pipeline.settings import Settings
from es_pipeline.source.mapping import NO_TENANT, Source
from es_pipeline.store import tenants


@dataclass(frozen=True)
class RangeStatus:
    range_key: str
    min_watermark: int
    max_watermark: int
    horizon: int
    extractable: int  # committed, below H, not yet in the lake
    behind_horizon: int  # committed at or above H: waits for older transactions to end


def range_status(conn: psycopg.Connection, source: Source, consumer: str, r: SliceRange, horizon: int) -> RangeStatus:
    wm = read_watermarks(conn, consumer, r.slices)
    pairs = [(s, w) for s, w in wm.items() if w < horizon]
    return RangeStatus(
        r.key,
        min(wm.values()),
        max(wm.values()),
        horizon,
        reader.count_between(conn, source, pairs, horizon),
        reader.count_between(conn, source, [(s, max(w, horizon)) for s, w in wm.items()], None),
    )


def format_table(rows: list[RangeStatus], oldest_open_tx: float) -> str:
    head = ("range", "watermark (min..max)", "horizon", "to extract", "behind horizon")
    body = [
        (
            r.range_key,
            f"{r.min_watermark}" if r.min_watermark == r.max_watermark else f"{r.min_watermark}..{r.max_watermark}",
            str(r.horizon),
            f"{r.extractable:,}",
            f"{r.behind_horizon:,}",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(b, widths, strict=True))) for b in body]
    lines.append(f"oldest open transaction holding the horizon: {oldest_open_tx:.1f} s")
    return "\n".join(lines)


def status_report(settings: Settings) -> str:
    """The status table of every range of `settings`, at one horizon."""
    consumer = settings.source.consumer
    with OffsetSession(settings.pg_dsn, consumer, run_id="status", label="status", source=settings.source) as s:
        s.check_source()  # a moved store would show nothing to do: say so instead
        horizon = s.horizon()
        rows = [range_status(s.conn, settings.source, consumer, r, horizon) for r in split(settings.slice_ranges)]
        report = format_table(rows, reader.oldest_open_transaction_seconds(s.conn))
        return report + "".join(f"\n{line}" for line in lost_tenants(s.conn, settings))


def lost_tenants(conn: psycopg.Connection, settings: Settings) -> list[str]:
    """A line for each tenant the lake holds whose events left the store without `tenant erase`."""
    if settings.source.tenant == NO_TENANT:
        return []
    counts = lake_erase.tenant_counts(EVENTS.path(settings.warehouse))
    return [
        f"tenant {t!r}: {n:,} events in the lake, none in {settings.source.label}, and no erasure recorded: its "
        f"partition was dropped or emptied outside `es-pipeline tenant erase`. Restore it, or run "
        f"`es-pipeline tenant erase {t} --yes` to remove it from the lake too."
        for t, n in tenants.missing(conn, settings.source, counts).items()
    ]
