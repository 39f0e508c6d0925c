"""The check of the catalog: it names exactly the lake's tables, each at its location (lake/read/metastore.py)."""

from __future__ import annotations

from es_pipeline.checks.check import Check, Given, Outcome
from es_pipeline.lake.read import metastore


def matches_lake(given: Given) -> Outcome:
    if given.metastore is None:
        return Outcome(True, {"note": "no catalog (ES_PIPELINE_METASTORE_DSN=off)"})
    if metastore.never_synced(given.metastore):
        return Outcome(True, {"note": "no sync yet: `es-pipeline catalog sync`, or the `catalog` asset's sensor"})
    diff = metastore.difference(given.metastore, given.warehouse)
    return Outcome(not diff, {
        "tables_missing": len(diff.missing), "tables_not_in_lake": len(diff.extra), "tables_moved": len(diff.moved),
        "examples": ", ".join([*sorted(diff.missing)[:3], *diff.extra[:3], *sorted(diff.moved)[:3]]) or "-"})


CHECKS = [Check(
    "catalog_matches_lake", "catalog",
    "The catalog (the Hive metastore in `ES_PIPELINE_METASTORE_DSN`) names exactly the lake's Delta tables, each at "
    "its location: none missing, none the lake no longer has. After a sync it must pass; between syncs a table a run "
    "just made waits for the next (the `catalog` sensor starts one within a minute).",
    matches_lake)]
