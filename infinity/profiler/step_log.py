"""`steps_per_print`: rank 0 prints one line every that many optimizer steps, as DeepSpeed's engine logs its
progress: the step, the steps skipped (fp16 overflow), each param group's learning rate and, where clipping
or fp16 took it, the global gradient norm. A caller that shows its own progress (the CLI) turns it off.
"""

from __future__ import annotations

import sys
from typing import TextIO


class StepLog:
    """Prints one line for every `print_every`-th optimizer step, on rank 0 and while `enabled`."""

    def __init__(self, print_every: int, rank: int, stream: TextIO | None = None) -> None:
        self.print_every = print_every
        self.enabled = rank == 0
        self.stream = stream

    def due(self, step: int) -> bool:
        """Whether optimizer step `step` (counted from 1) gets a line."""
        return self.enabled and step % self.print_every == 0

    def write(self, step: int, skipped: int, lrs: list[float], grad_norm: float | None) -> None:
        rates = ", ".join(f"{lr:.4e}" for lr in lrs)
        norm = f" | grad norm {grad_norm:.4e}" if grad_norm is not None else ""
        stream = self.stream or sys.stdout
        print(f"infinity: step {step} | skipped {skipped} | lr [{rates}]{norm}", file=stream, flush=True)
