"""Interval arithmetic on ``(start, end)`` pairs, for the trace readers.

Standard library only. An interval list is "merged" when it is sorted, without
overlaps and without empty intervals; :func:`union` makes one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["Interval", "union", "measure", "overlap", "clip", "percentile"]

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The merged union of ``intervals`` (empty and reversed ones are dropped)."""
    out: list[Interval] = []
    for start, end in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def measure(merged: Sequence[Interval]) -> float:
    """The total length of a merged interval list."""
    return sum(end - start for start, end in merged)


def overlap(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """The length of the intersection of two merged interval lists (one sweep)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        # The one that ends first cannot meet anything further in the other list.
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return total


def clip(merged: Sequence[Interval], lo: float, hi: float) -> list[Interval]:
    """A merged list cut to the window ``[lo, hi]``."""
    out = []
    for start, end in merged:
        start, end = max(start, lo), min(end, hi)
        if end > start:
            out.append((start, end))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between the closest ranks (NumPy's default).

    NaN for no values.
    """
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
