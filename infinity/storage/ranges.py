"""Best-fit allocation of byte ranges inside a region that can grow (a host slab, the swap file)."""

from __future__ import annotations

import bisect


class RangeAllocator:
    """Hands out [offset, offset + n) ranges of a region of `size` bytes; frees coalesce with neighbours.

    Not thread-safe: its owner holds a lock.
    """

    def __init__(self, size: int = 0) -> None:
        self.size = 0
        self.used = 0
        self._starts: list[int] = []  # free ranges, sorted by start
        self._lengths: dict[int, int] = {}
        self.grow(size)

    def grow(self, extra: int) -> None:
        """Append `extra` free bytes at the end of the region."""
        if extra > 0:
            start = self.size
            self.size += extra
            self._insert(start, extra)

    def alloc(self, n: int) -> int | None:
        """The offset of `n` bytes taken from the smallest free range that holds them (the lowest such), or None
        when none is large enough. Best fit keeps large ranges whole for large requests."""
        best = None
        for start in self._starts:
            length = self._lengths[start]
            if length >= n and (best is None or length < self._lengths[best]):
                best = start
                if length == n:
                    break
        if best is None:
            return None
        length = self._lengths[best]
        self._remove(best)
        if length > n:
            self._insert_raw(best + n, length - n)
        self.used += n
        return best

    def largest_free(self) -> int:
        """The longest free range, in bytes (0 when none is free)."""
        return max(self._lengths.values(), default=0)

    def free(self, start: int, n: int) -> None:
        self.used -= n
        self._insert(start, n)

    def tail_free(self) -> int:
        """Free bytes that end exactly at the end of the region (what growing would extend)."""
        if self._starts:
            last = self._starts[-1]
            if last + self._lengths[last] == self.size:
                return self._lengths[last]
        return 0

    def _insert(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and start + n == self._starts[i]:  # merge with the next range
            nxt = self._starts[i]
            n += self._lengths.pop(nxt)
            del self._starts[i]
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] == start:  # merge into the previous range
                self._lengths[prev] += n
                return
        self._insert_raw(start, n)

    def _insert_raw(self, start: int, n: int) -> None:
        bisect.insort(self._starts, start)
        self._lengths[start] = n

    def _remove(self, start: int) -> None:
        del self._starts[bisect.bisect_left(self._starts, start)]
        del self._lengths[start]
