"""The check of `snapshots`: the store holds the latest snapshot of every stream in the lake."""

from __future__ import annotations

from es_pipeline.checks.check import Check, Given, Outcome
from es_pipeline.lake.state.snapshots import not_in_store, not_in_store_small


def match_store(given: Given) -> Outcome:
    store = given.store()
    if not store.has_snapshots_table():
        return Outcome(False, {
            "streams_differing": 0, "note": "the store has no snapshot table: run `es-pipeline db migrate` (the native "
            "store) or `es-pipeline source adopt` (another store: it creates es_pipeline.snapshots)"})
    small = not_in_store_small(given.warehouse, store)  # no JVM, up to SMALL_SNAPSHOT_ROWS
    if small is not None:
        n, examples = small.num_rows, small.slice(0, 5).to_pylist()
    else:
        missing = not_in_store(given.engine.session(), given.warehouse, store)
        n, examples = int(missing.count()), [r.asDict() for r in missing.limit(5).collect()]
    return Outcome(n == 0, {"streams_differing": n,
                            "examples": ", ".join(f"{r['stream_id']}@{r['version']}" for r in examples)})


CHECKS = [Check(
    "snapshots_match_store", "snapshots",
    "For every stream, the event store's snapshot table (`es.snapshots`, or `es_pipeline.snapshots` for an adopted "
    "store) holds the latest snapshot in the lake (same version and revision), so that `load` starts from it. The "
    "next `snapshots` run writes back any that differ.",
    match_store, blocking=True)]
