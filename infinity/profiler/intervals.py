"""Sets of time as sorted lists of disjoint [start, end) spans: union, intersection, difference, length."""

from __future__ import annotations

import bisect
from collections.abc import Iterable

Span = tuple[int, int]


def merge(spans: Iterable[Span]) -> list[Span]:
    """The union of `spans` as sorted, disjoint, non-touching spans (empty spans dropped)."""
    out: list[list[int]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(spans: list[Span]) -> int:
    """Nanoseconds covered by merged `spans`."""
    return sum(e - s for s, e in spans)


def intersect(a: list[Span], b: list[Span]) -> list[Span]:
    """The time in both merged sets; costs O(len(b) log len(a) + overlaps)."""
    starts = [s for s, _ in a]
    out: list[Span] = []
    for lo, hi in b:
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        while i < len(a) and a[i][0] < hi:
            s, e = max(a[i][0], lo), min(a[i][1], hi)
            if e > s:
                out.append((s, e))
            i += 1
    return out


def subtract(a: list[Span], b: list[Span]) -> list[Span]:
    """The time of merged `a` outside merged `b`."""
    out: list[Span] = []
    starts = [s for s, _ in b]
    for lo, hi in a:
        cursor = lo
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        while i < len(b) and b[i][0] < hi:
            s, e = b[i]
            if e > cursor:
                if s > cursor:
                    out.append((cursor, min(s, hi)))
                cursor = max(cursor, e)
            i += 1
        if cursor < hi:
            out.append((cursor, hi))
    return out


def overlap_ns(span: Span, merged: list[Span]) -> int:
    """Nanoseconds of `span` inside merged `merged`."""
    return length(intersect(merged, [span])) if span[1] > span[0] else 0
