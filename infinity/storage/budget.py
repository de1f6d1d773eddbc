"""The waiting discipline shared by every tier allocator: a byte budget, never exceeded.

`acquire` takes memory when it fits, else asks the owner's `reclaim` hook to free a cached copy,
else waits for a `release`. It raises `BudgetError` at once when the request is larger than the
whole budget, and after `timeout_s` otherwise, so a caller that holds everything fails loudly
instead of hanging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from infinity.storage.errors import BudgetError

Reclaim = Callable[[int], bool]  # asked to free memory for a request of n bytes; True if it freed any


class BudgetedAllocator:
    """Base of the host buffer pool and the device memory: live bytes <= budget_bytes, always."""

    name = "memory"

    def __init__(self, budget_bytes: int | None, timeout_s: float = 300.0) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"{self.name} budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.timeout_s = timeout_s
        self.reclaim: Reclaim | None = None
        self.live_bytes = 0
        self.high_water_bytes = 0
        self._cond = threading.Condition()
        self._waiting = 0
        self._releases = 0

    @property
    def waiting(self) -> int:
        """Callers blocked for memory now; owners free released copies at once while this is > 0."""
        return self._waiting

    def acquire(
        self,
        nbytes: int,
        wait: bool = True,
        timeout_s: float | None = None,
        on_wait: Callable[[int, int], None] | None = None,
    ) -> Any:
        """Memory for `nbytes`, waiting (up to timeout_s) for a release when the budget is spent.

        Without `wait`, returns None instead of reclaiming or waiting. `on_wait(start_ns, end_ns)` is called
        once the memory came, if it had to wait for a release (reclaiming alone is not waiting).
        """
        need = self._footprint(nbytes)
        if self.budget_bytes is not None and need > self.budget_bytes:
            raise BudgetError(
                f"{self.name}: a request of {need} bytes can never fit the budget of {self.budget_bytes} bytes; "
                "raise the budget or split the tensor"
            )
        with self._cond:
            item = self._take(need)
            if item is not None or not wait:
                return item
            self._waiting += 1
        waited_from = None
        try:
            timeout = self.timeout_s if timeout_s is None else timeout_s
            deadline = time.monotonic() + timeout
            while True:
                with self._cond:
                    seen = self._releases
                    item = self._take(need)
                    if item is not None:
                        break
                if self.reclaim is not None and self.reclaim(need):
                    continue
                with self._cond:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise BudgetError(
                            f"{self.name}: waited {timeout:.1f} s for {need} bytes; {self.live_bytes} of "
                            f"{self.budget_bytes} budget bytes stay in use and none came back{self._shortfall(need)}. "
                            "Release fetched copies (or wait for in-flight moves) before asking for more"
                        )
                    if waited_from is None:
                        waited_from = time.perf_counter_ns()
                    self._cond.wait_for(lambda s=seen: self._releases != s, timeout=left)
        finally:
            with self._cond:
                self._waiting -= 1
        if waited_from is not None and on_wait is not None:
            on_wait(waited_from, time.perf_counter_ns())
        return item

    def release(self, item: Any) -> None:
        with self._cond:
            self._give_back(item)
            self._releases += 1
            self._cond.notify_all()

    def poke(self) -> None:
        """Wake waiters to try their reclaim hook again (something became reclaimable)."""
        with self._cond:
            if self._waiting:
                self._releases += 1
                self._cond.notify_all()

    def reset_high_water(self) -> None:
        with self._cond:
            self.high_water_bytes = self.live_bytes

    def _account(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.high_water_bytes = max(self.high_water_bytes, self.live_bytes)

    def _fits(self, nbytes: int) -> bool:
        return self.budget_bytes is None or self.live_bytes + nbytes <= self.budget_bytes

    # Subclasses: called with the condition held.
    def _footprint(self, nbytes: int) -> int:
        return nbytes

    def _shortfall(self, need: int) -> str:
        """Why `need` bytes were refused when the budget alone does not say (e.g. free bytes split up)."""
        return ""

    def _take(self, need: int) -> Any:
        raise NotImplementedError

    def _give_back(self, item: Any) -> None:
        raise NotImplementedError
