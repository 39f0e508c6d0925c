"""The picture in docs/analysts.md: the 15 products with the most revenue, and their units, from a lake's `events_item_added`, as SVG.

`python -m es_pipeline.dev.analyst_picture [warehouse] [out.svg]` (defaults: ES_PIPELINE_WAREHOUSE,
docs/analysts-revenue.svg). The query is the first of the doc's three questions, run by DuckDB as
`es-pipeline sql` runs it; the drawing is plain SVG (no plotting library).
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


def main(argv: list[str]) -> int:
    warehouse = argv[0] if argv else Settings.from_env().warehouse
    out = Path(argv[1]) if len(argv) > 1 else PROJECT_ROOT / "docs" / "analysts-revenue.svg"
    rows = query.run(warehouse, QUERY).rows.to_pylist()
    out.write_text(draw(rows))
    print(f"{len(rows)} products drawn into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
