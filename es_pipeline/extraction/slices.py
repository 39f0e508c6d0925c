"""Slices and slice ranges: 1024 slices, split into contiguous ranges (docs/architecture.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from es_pipeline.errors import ConfigError

NUM_SLICES = 1024
_KEY = re.compile(r"^(\d{4})-(\d{4})$")


@dataclass(frozen=True, order=True)
class SliceRange:
    """Slices lo..hi inclusive. Its Dagster partition key is `f"{lo:04d}-{hi:04d}"`."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not (0 <= self.lo <= self.hi < NUM_SLICES):
            raise ValueError(f"invalid slice range {self.lo}..{self.hi}: need 0 <= lo <= hi < {NUM_SLICES}")

    @property
    def key(self) -> str:
        return f"{self.lo:04d}-{self.hi:04d}"

    @property
    def slices(self) -> list[int]:
        return list(range(self.lo, self.hi + 1))

    def __contains__(self, slice_: object) -> bool:
        return isinstance(slice_, int) and self.lo <= slice_ <= self.hi

    @classmethod
    def from_key(cls, key: str) -> SliceRange:
        m = _KEY.match(key)
        if not m:
            raise ValueError(f"invalid slice range key {key!r}: expected 'LLLL-HHHH', e.g. '0000-0127'")
        return cls(int(m.group(1)), int(m.group(2)))

    def __str__(self) -> str:
        return self.key


def split(n: int) -> list[SliceRange]:
    """`n` contiguous ranges covering all 1024 slices, sizes differing by at most one."""
    if not 1 <= n <= NUM_SLICES:
        raise ConfigError("ES_PIPELINE_SLICE_RANGES", str(n), f"a whole number of ranges between 1 and {NUM_SLICES}")
    base, extra = divmod(NUM_SLICES, n)
    ranges, lo = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        ranges.append(SliceRange(lo, lo + size - 1))
        lo += size
    return ranges
