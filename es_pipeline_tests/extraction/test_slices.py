"""Slices and slice ranges (pure): every split covers the 1,024 slices once, in contiguous ranges of near-equal
size, and a range's partition key reads back as the same range."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from es_pipeline.errors import ConfigError
from es_pipeline.extraction.slices import NUM_SLICES, SliceRange, split


@given(st.integers(min_value=1, max_value=NUM_SLICES))
def test_a_split_covers_every_slice_once_in_contiguous_ranges_of_near_equal_size(n: int) -> None:
    ranges = split(n)
    assert len(ranges) == n
    assert [s for r in ranges for s in r.slices] == list(range(NUM_SLICES))
    sizes = {r.hi - r.lo + 1 for r in ranges}
    assert max(sizes) - min(sizes) <= 1
    assert all(SliceRange.from_key(r.key) == r for r in ranges)


@pytest.mark.parametrize("n", [0, NUM_SLICES + 1, -3])
def test_a_split_outside_1_to_1024_names_the_setting(n: int) -> None:
    with pytest.raises(ConfigError, match="ES_PIPELINE_SLICE_RANGES"):
        split(n)


@pytest.mark.parametrize("key", ["0000-127", "0128-0000", "0000-1024", "a-b", ""])
def test_a_bad_key_or_range_is_refused(key: str) -> None:
    with pytest.raises(ValueError):
        SliceRange.from_key(key)


def test_membership_and_order() -> None:
    r = SliceRange(128, 255)
    assert 128 in r and 255 in r and 127 not in r and "128" not in r
    assert str(r) == "0128-0255" and SliceRange(0, 127) < r
