"""The settings `infinity tune` searches, each with a ladder of values to step along.

A knob is a dotted key path of the DeepSpeed-style JSON config ("aio.queue_depth"). `read` takes its
value from the resolved config (every default filled in); `write` returns a copy of the user's raw
config with the key set, so a tuned file is the user's file with only the tuned keys changed.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

PREFETCH = "zero_optimization.stage3_prefetch_bucket_size"
PARAM_BUFFERS = "zero_optimization.offload_param.buffer_count"
OPTIMIZER_BUFFERS = "zero_optimization.offload_optimizer.buffer_count"
QUEUE_DEPTH = "aio.queue_depth"
BLOCK_SIZE = "aio.block_size"
INTRA_OP = "aio.intra_op_parallelism"

ORDER = (PREFETCH, PARAM_BUFFERS, OPTIMIZER_BUFFERS, QUEUE_DEPTH, BLOCK_SIZE, INTRA_OP)
PREFETCH_BLOCKS = (0, 1, 2, 4, 8, 16)  # the prefetch ladder, in blocks of the model's largest block


@dataclass(frozen=True)
class Knob:
    """One searched setting: its key path, the values it may take (ascending), its other key names."""

    name: str
    ladder: tuple[int, ...]
    aliases: tuple[str, ...] = ()  # other names of the last key ("thread_count"), removed when it is written

    def read(self, resolved: dict[str, Any]) -> int:
        node: Any = resolved
        for key in self.name.split("."):
            node = node[key]
        return int(node)

    def write(self, raw: dict[str, Any], value: int) -> dict[str, Any]:
        """A deep copy of `raw` with this knob set to `value` (sections created as needed)."""
        out = copy.deepcopy(raw)
        *sections, last = self.name.split(".")
        node = out
        for key in sections:
            node = node.setdefault(key, {})
        for alias in self.aliases:
            node.pop(alias, None)
        node[last] = value
        return out

    def around(self, value: int, steps: int) -> list[int]:
        """Up to `steps` ladder values above `value` (ascending), then up to `steps` below (descending)."""
        above = [v for v in self.ladder if v > value][:steps]
        below = [v for v in reversed(self.ladder) if v < value][:steps]
        return above + below

    def next_value(self, value: int, direction: int) -> int | None:
        """The ladder's next value above (`direction` 1) or below (-1) `value`, or None at its end."""
        beyond = [v for v in self.ladder if (v - value) * direction > 0]
        if not beyond:
            return None
        return min(beyond) if direction > 0 else max(beyond)


def all_knobs(block_elems: int, cpus: int | None = None) -> dict[str, Knob]:
    """Every knob, by name, in search order; the prefetch ladder counts blocks of `block_elems`."""
    cpus = cpus or os.cpu_count() or 1
    return {
        PREFETCH: Knob(PREFETCH, tuple(n * block_elems for n in PREFETCH_BLOCKS)),
        PARAM_BUFFERS: Knob(PARAM_BUFFERS, (1, 2, 3, 4, 5, 6, 8, 12, 16)),
        OPTIMIZER_BUFFERS: Knob(OPTIMIZER_BUFFERS, (1, 2, 3, 4, 6, 8, 12, 16)),
        QUEUE_DEPTH: Knob(QUEUE_DEPTH, (1, 2, 4, 8, 16, 32, 64, 128)),
        BLOCK_SIZE: Knob(BLOCK_SIZE, tuple(4096 << (2 * i) for i in range(7))),  # 4 KiB .. 16 MiB
        INTRA_OP: Knob(INTRA_OP, tuple(n for n in (1, 2, 4, 8) if n <= max(cpus, 1)), aliases=("thread_count",)),
    }


def applicable(resolved: dict[str, Any]) -> list[str]:
    """The knobs that can matter for this config on one rank (as tune runs): the prefetch bucket only with
    offloaded parameters (one rank keeps device-resident blocks in place: nothing is gathered), buffer
    counts and aio only where NVMe is used. `effects.effective_knob` then drops the buffer counts where
    the budget plan does not depend on them."""
    zero = resolved["zero_optimization"]
    param_nvme = zero["offload_param"]["device"] == "nvme"
    optim_nvme = zero["offload_optimizer"]["device"] == "nvme"
    gathered = zero["offload_param"]["device"] != "none"
    wanted = {PREFETCH: gathered, PARAM_BUFFERS: param_nvme, OPTIMIZER_BUFFERS: optim_nvme}
    wanted |= dict.fromkeys((QUEUE_DEPTH, BLOCK_SIZE, INTRA_OP), param_nvme or optim_nvme)
    return [name for name in ORDER if wanted[name]]


def select(names: Iterable[str], only: str | None) -> list[str]:
    """`names` restricted to the comma-separated `only` (full names or their last part: "queue_depth")."""
    names = list(names)
    if not only:
        return names
    chosen = []
    for item in (s.strip() for s in only.split(",") if s.strip()):
        matches = [n for n in ORDER if n == item or n.rsplit(".", 1)[-1] == item]
        if not matches:
            raise ValueError(f"unknown knob {item!r}; knobs: {', '.join(ORDER)}")
        chosen += [m for m in matches if m not in chosen]
    return [n for n in names if n in chosen]


def format_value(name: str, value: int) -> str:
    """A knob's value for people: block sizes in KiB / MiB, counts as they are."""
    if name == BLOCK_SIZE:
        return f"{value >> 20} MiB" if value >= 1 << 20 else f"{value >> 10} KiB"
    return f"{value:,}"
