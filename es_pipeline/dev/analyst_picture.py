"""The pictures in docs/analysts.md, as SVG (no plotting library), each from a query DuckDB runs as `es-pipeline sql`
runs it:

- `python -m es_pipeline.dev.analyst_picture [warehouse] [out.svg]`: the 15 products with the most revenue, and
  their units, from `events_item_added` (the first of the doc's three questions; default docs/analysts-revenue.svg);
- `python -m es_pipeline.dev.analyst_picture --open-carts [warehouse] [out.svg]`: open and checked-out carts over
  the span of `stream_state_cart_history`, 60 moments (default docs/analysts-open-carts.svg).

The warehouse defaults to ES_PIPELINE_WAREHOUSE.
"""

from __future__ import annotations

import sys
from html import escape
from pathlib import Path

from es_pipeline.lake.read import query
from es_pipeline.settings import PROJECT_ROOT, Settings

QUERY = ("SELECT sku, sum(qty) AS units, round(sum(qty * unit_price), 2) AS revenue "
         "FROM events_item_added GROUP BY sku ORDER BY revenue DESC LIMIT 15")


def draw(rows: list[dict], *, width: int = 640) -> str:
    """Horizontal bars of revenue per product, units written beside each."""
    bar_h, gap, left, top = 22, 8, 90, 40
    height = top + len(rows) * (bar_h + gap) + 20
    most = max((float(r["revenue"] or 0) for r in rows), default=1.0) or 1.0
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           'font-size="13">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           '<text x="10" y="22" font-size="15" font-weight="bold">The 15 products with the most revenue (events_item_added)</text>']
    for i, r in enumerate(rows):
        y = top + i * (bar_h + gap)
        w = (width - left - 150) * float(r["revenue"] or 0) / most
        out += [f'<text x="{left - 8}" y="{y + 16}" text-anchor="end">{escape(str(r["sku"]))}</text>',
                f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="#3b7dd8"/>',
                f'<text x="{left + w + 6:.1f}" y="{y + 16}">{float(r["revenue"] or 0):,.2f} · {int(r["units"] or 0):,} units</text>']
    out.append("</svg>")
    return "\n".join(out) + "\n"


# The carts' states at 60 moments over their history's span: a state counts where its interval holds the moment.
OPEN_CARTS = """
WITH span AS (SELECT epoch_us(min(valid_from)) AS lo, epoch_us(max(valid_from)) AS hi FROM stream_state_cart_history),
moments AS (SELECT make_timestamptz(CAST(lo + (hi - lo) * i / 59 AS BIGINT)) AS at FROM span, range(60) AS t(i))
SELECT m.at, count(c.stream_id) FILTER (WHERE c.status = 'open') AS open_carts,
       count(c.stream_id) FILTER (WHERE c.status = 'checked_out') AS checked_out
FROM moments m LEFT JOIN stream_state_cart_history c
     ON c.valid_from <= m.at AND (c.valid_to IS NULL OR c.valid_to > m.at)
GROUP BY 1 ORDER BY 1
"""


def draw_series(rows: list[dict], *, width: int = 640, height: int = 300) -> str:
    """Open and checked-out carts at each moment, as two lines over the history's span."""
    left, right, top, bottom = 50, 20, 40, 40
    most = max((max(r["open_carts"], r["checked_out"]) for r in rows), default=1) or 1
    span = max(len(rows) - 1, 1)

    def point(i: int, v: float) -> str:
        return f"{left + (width - left - right) * i / span:.1f},{top + (height - top - bottom) * (1 - v / most):.1f}"

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
           '<text x="10" y="22" font-size="15" font-weight="bold">Carts by state over time '
           '(stream_state_cart_history)</text>',
           f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="#999"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#999"/>',
           f'<text x="{left - 6}" y="{top + 4}" text-anchor="end">{most}</text>',
           f'<text x="{left - 6}" y="{height - bottom + 4}" text-anchor="end">0</text>']
    for key, colour in (("open_carts", "#3b7dd8"), ("checked_out", "#d8783b")):
        points = " ".join(point(i, r[key]) for i, r in enumerate(rows))
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{points}"/>')
    if rows:
        first, last = rows[0]["at"], rows[-1]["at"]
        out += [f'<text x="{left}" y="{height - bottom + 18}">{escape(f"{first:%Y-%m-%d %H:%M:%S} UTC")}</text>',
                f'<text x="{width - right}" y="{height - bottom + 18}" text-anchor="end">'
                f'{escape(f"{last:%H:%M:%S}")}</text>']
    out += [f'<text x="{width - right - 180}" y="{top + 4}" fill="#3b7dd8">open</text>',
            f'<text x="{width - right - 120}" y="{top + 4}" fill="#d8783b">checked out</text>', "</svg>"]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    series = bool(argv) and argv[0] == "--open-carts"
    argv = argv[1:] if series else argv
    warehouse = argv[0] if argv else Settings.from_env().warehouse
    name = "analysts-open-carts.svg" if series else "analysts-revenue.svg"
    out = Path(argv[1]) if len(argv) > 1 else PROJECT_ROOT / "docs" / name
    if series:
        moments = query.run(warehouse, OPEN_CARTS).rows.to_pylist()
        out.write_text(draw_series(moments))
        print(f"{len(moments)} moments drawn into {out}")
        return 0
    rows = query.run(warehouse, QUERY).rows.to_pylist()
    out.write_text(draw(rows))
    print(f"{len(rows)} products drawn into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
