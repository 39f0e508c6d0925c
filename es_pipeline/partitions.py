"""The `slice_ranges` partitions: one key per slice range, e.g. `0000-0127` (DESIGN §4)."""

from __future__ import annotations

import dagster as dg

from es_pipeline.slices import split


def slice_ranges_partitions(n: int) -> dg.StaticPartitionsDefinition:
    return dg.StaticPartitionsDefinition([r.key for r in split(n)])
