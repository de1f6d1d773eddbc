"""`wall_clock_breakdown`: where each optimizer step's time went (forward, backward, step), as DeepSpeed prints it.

The engine times its forward, backward and optimizer step with `time(phase)`; `end_step` closes an optimizer
step (its micro-batches summed), keeps it as `last_s`, and on rank 0 prints it every `print_every` steps.
On a GPU each timer synchronizes the device first, so it measures the work rather than the launch (as
DeepSpeed's timers do when the breakdown is on). Disabled, it costs one branch per call.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

PHASES = ("forward", "backward", "step")


class WallClock:
    """Per-step seconds of each phase; see the module docstring."""

    def __init__(
        self, enabled: bool, print_every: int, rank: int, synchronize: Callable[[], None] | None = None, stream=None
    ) -> None:
        self.enabled = enabled
        self.print_every = print_every
        self.rank = rank
        self.synchronize = synchronize
        self.stream = stream
        self.last_s: dict[str, float] = {}  # the last finished optimizer step's seconds per phase
        self._open = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def time(self, phase: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.synchronize is not None:
            self.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.synchronize is not None:
                self.synchronize()
            self._open[phase] += time.perf_counter() - start

    def end_step(self, step: int) -> None:
        """Optimizer step `step` (counted from 1) is done: keep its split, print it every `print_every` steps."""
        if not self.enabled:
            return
        self.last_s, self._open = self._open, dict.fromkeys(PHASES, 0.0)
        if self.rank == 0 and step % self.print_every == 0:
            split = " | ".join(f"{phase}: {1000 * self.last_s[phase]:.2f}" for phase in PHASES)
            print(f"infinity: step {step} time (ms) | {split}", file=self.stream or sys.stdout)
