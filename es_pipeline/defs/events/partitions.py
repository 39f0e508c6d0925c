"""The `slice_ranges` partitions: one key per slice range, e.g. `0000-0127`."""

from __future__ import annotations

import dagster as dg

from es_pipeline.extraction.slices import split


def slice_ranges_partitions(n: int) -> dg.StaticPartitionsDefinition:
    return dg.StaticPartitionsDefinition([r.key for r in split(n)])
