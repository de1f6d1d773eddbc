"""A dependency-free progress display for training: one updating line on a TTY, plain lines otherwise.

Each update shows the step, the loss, tokens/s and the swap bandwidth of every tier pair (bytes the
engine moved since the previous update, divided by the time between them).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_rates(moved_now: dict[str, int], moved_before: dict[str, int], seconds: float) -> str:
    """ "host->device 1.23 GB/s  ..." for every tier pair that moved bytes in the interval."""
    parts = []
    for pair in sorted(moved_now):
        delta = moved_now[pair] - moved_before.get(pair, 0)
        if delta > 0 and seconds > 0:
            parts.append(f"{pair} {delta / seconds / 1e9:.3g} GB/s")
    return "  ".join(parts) if parts else "no swap"


class Progress:
    """Prints training progress to `stream`; on a TTY the line is redrawn in place (carriage return).

    `update` is cheap to call every step: a TTY redraw happens at most every `min_interval_s`, and a
    non-TTY line every `print_every` steps and at the last step.
    """

    def __init__(
        self,
        total_steps: int,
        tokens_per_step: int,
        stream: TextIO | None = None,
        print_every: int = 10,
        min_interval_s: float = 0.1,
        first_step: int = 0,
    ) -> None:
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.print_every = max(1, print_every)
        self.min_interval_s = min_interval_s
        self._last_t = time.perf_counter()
        self._last_step = first_step
        self._last_moved: dict[str, int] = {}
        self._last_draw = 0.0
        self._width = 0

    def update(self, step: int, loss: float, moved: dict[str, int], lr: float | None = None) -> None:
        """Record that `step` finished with `loss`; `moved` is the engine's cumulative bytes_moved."""
        now = time.perf_counter()
        last = step == self.total_steps
        if self.tty:
            if not last and now - self._last_draw < self.min_interval_s:
                return
        elif step % self.print_every and not last:
            return
        seconds = now - self._last_t
        tokens_s = (step - self._last_step) * self.tokens_per_step / seconds if seconds > 0 else 0.0
        lr_text = f"  lr {lr:.2e}" if lr is not None else ""
        line = (
            f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}  loss {loss:.4f}{lr_text}  "
            f"{tokens_s:,.0f} tokens/s  swap: {format_rates(moved, self._last_moved, seconds)}"
        )
        self._last_t, self._last_step, self._last_moved, self._last_draw = now, step, dict(moved), now
        if self.tty:
            pad = max(0, self._width - len(line))
            self._width = 0 if last else len(line)
            self.stream.write("\r" + line + " " * pad + ("\n" if last else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End an unfinished TTY line so that what is printed next starts on its own line."""
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0
