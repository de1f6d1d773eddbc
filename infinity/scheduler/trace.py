"""The recorded order in which blocks run, per phase, and the check that it still holds."""

from __future__ import annotations


class ExecutionTrace:
    """Block indices in the order one phase (forward or backward) used them.

    The first pass records; later passes compare step by step, and the first difference
    invalidates the trace, which is then recorded afresh from the next pass on.
    """

    def __init__(self) -> None:
        self.order: list[int] = []
        self.valid = False
        self._recording: list[int] = []
        self._pos = 0
        self._diverged = False
        self.invalidations = 0

    def start_pass(self) -> None:
        self._recording = []
        self._pos = 0
        self._diverged = False

    def visit(self, block: int) -> int | None:
        """Note that `block` runs now; return its position in the trace if the trace still holds."""
        self._recording.append(block)
        if self.valid and not self._diverged:
            if self._pos < len(self.order) and self.order[self._pos] == block:
                self._pos += 1
                return self._pos - 1
            self._diverged = True
            self.invalidations += 1
        return None

    def end_pass(self) -> None:
        if self._diverged or not self.valid or len(self._recording) != len(self.order):
            self.order = self._recording
            self.valid = bool(self.order)
        self._recording = []

    def upcoming(self, position: int) -> list[int]:
        return self.order[position + 1 :] if self.valid and not self._diverged else []

    def after(self, block: int) -> int | None:
        """The block the recorded order runs right after `block`'s first use; None where it is last, not in the
        order, or the order no longer holds."""
        if not self.valid or self._diverged or block not in self.order:
            return None
        i = self.order.index(block)
        return self.order[i + 1] if i + 1 < len(self.order) else None

    def next_use_distance(self, position: int, block: int, numel_of) -> int | None:
        """Elements gathered between this position and the block's next use, or None if not used again."""
        total = 0
        for b in self.upcoming(position):
            if b == block:
                return total
            total += numel_of(b)
        return None
