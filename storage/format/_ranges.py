"""Flat-range arithmetic: ranges ``[offset, offset + length)`` of a row-major flattened tensor."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import NamedTuple


class Range(NamedTuple):
    """Elements ``[offset, offset + length)`` of a tensor's row-major flattening."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def intersect(a: Range, b: Range) -> Range | None:
    """The overlap of two ranges, or None when they share no element."""
    start, end = max(a.offset, b.offset), min(a.end, b.end)
    return Range(start, end - start) if end > start else None


def check_range(r: Range, numel: int, what: str) -> None:
    """ValueError unless ``r`` is a non-negative range inside a tensor of ``numel`` elements."""
    if r.offset < 0 or r.length < 0 or r.end > numel:
        raise ValueError(
            f"{what}: range offset={r.offset} length={r.length} is outside [0, {numel}) "
            "(offsets and lengths must be non-negative and end within the tensor)"
        )


def check_disjoint_cover(ranges: Sequence[Range], numel: int, what: str) -> None:
    """ValueError unless ``ranges`` (sorted by offset) tile ``[0, numel)`` with no gap or overlap."""
    pos = 0
    for r in ranges:
        check_range(r, numel, what)
        if r.offset < pos:
            raise ValueError(f"{what}: ranges overlap at element {r.offset}")
        if r.offset > pos:
            raise ValueError(f"{what}: elements [{pos}, {r.offset}) are not covered")
        pos = r.end
    if pos != numel:
        raise ValueError(f"{what}: elements [{pos}, {numel}) are not covered")


def segments(ranges: Iterable[Range]) -> list[Range]:
    """Split the union of ``ranges`` at every range boundary into disjoint elementary segments."""
    ranges = [r for r in ranges if r.length > 0]
    bounds = sorted({r.offset for r in ranges} | {r.end for r in ranges})
    out = []
    for lo, hi in itertools.pairwise(bounds):
        if any(r.offset <= lo and hi <= r.end for r in ranges):
            out.append(Range(lo, hi - lo))
    return out


def coalesce(spans: Iterable[tuple[int, int]], gap: int = 0) -> list[tuple[int, int]]:
    """Merge ``(start, end)`` spans that overlap or lie within ``gap`` of each other."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
