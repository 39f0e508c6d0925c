"""The Delta lake: every table es_pipeline keeps, built from `events`.

Read it from the ground up (docs/architecture.md, "Layout", has the whole table):

- `delta/`: the Delta primitives: paths, reads and idempotent writes (`tables`), a table's definition
  (`definition`), a table's current files (`current`), streaming Arrow appends, a tenant's erasure from a table
  (`erase`);
- `spark/`: the Spark session with the cached Delta jars, and Java;
- `events.py`: the `events` table, defined once;
- `kernel/`: the projection kernel, what every table built from `events` shares: its position, `events`' change
  feed, one update at a time (`turn`), the engine rule, the one runner of an update (decision 0049);
- `typed/`: the rule by which a JSON value becomes a typed column (`shapes`), a batch's typed rows, the typed
  event tables;
- `aggregates/`: additive aggregates of `events` (`stream_catalog`, `event_type_daily`);
- `state/`: the per-stream fold (`fold`, `state_json`, `whole_fold`), `stream_state`, typed state, snapshots;
- `cross_stream.py`: the team's cross-stream projections;
- `projections.py`: every table a domain builds from `events`, as plug-ins, in the order a follow takes them;
- `follow.py` (a tailing run's increments of every table), `inventory.py` (every table and its turn),
  `maintenance.py` (compaction and vacuum);
- `read/`: for analysts and monitoring: `es-pipeline sql` (`query`), Spark's catalog, how far behind each is.

Each table's module holds its definition and both of its engine paths (Spark, and Arrow with delta-rs).
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    """`from es_pipeline.lake import query`, as docs/analysts.md shows it, without importing DuckDB with the lake."""
    if name == "query":
        return importlib.import_module("es_pipeline.lake.read.query")
    raise AttributeError(f"module 'es_pipeline.lake' has no attribute {name!r}")
