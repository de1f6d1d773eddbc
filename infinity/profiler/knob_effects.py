"""Which setting changes a thing in this run, and to what value: the diagnosis names no key that does nothing.

The rules read the run's resolved config (the trace's meta `config`) and mirror where infinity uses
each key (tests hold every proposal to a change of `engine.budgets.plan_budgets` or of the run):
- parameters kept in host memory (the NVMe parameter read-ahead): with an explicit
  `zero_optimization.host_budget_bytes`, that budget; otherwise, when the host tier is bounded (no
  shard lives on the host), `offload_param.buffer_count` x `buffer_size` capped by `max_in_cpu`,
  never below four of the largest shards; when the optimizer lives on the host the host is unbounded
  and only `offload_param.device` "cpu" keeps the parameters there. `pipeline_read`/`pipeline_write`,
  `buffer_size` alone below four shards and `max_in_cpu` above the buffers change nothing.
- the NVMe optimizer's window: `offload_optimizer.buffer_count`, or the host budget when it is explicit.
- the prefetch bucket: only where blocks are gathered (several ranks, or offloaded parameters).
- aio: only where something lives on NVMe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

AIO_BLOCK_MAX = 16 << 20


@dataclass(frozen=True)
class Change:
    """Set `setting` (a dotted key path from the config's top level) from `current` to `value`, and the
    keys of `also` to their values when one key alone would change nothing."""

    setting: str
    current: Any
    value: Any
    note: str = ""
    also: tuple[tuple[str, Any], ...] = ()


def _zero(config: dict) -> dict:
    return config.get("zero_optimization") or {}


def _device(config: dict, section: str) -> str:
    return (_zero(config).get(section) or {}).get("device", "none")


def itemsize(config: dict) -> int:
    """Bytes per element of the compute dtype (parameter shards on NVMe are stored in it)."""
    half = (config.get("bf16") or {}).get("enabled") is True or (config.get("fp16") or {}).get("enabled") is True
    return 2 if half else 4


def host_bounded(config: dict) -> bool:
    """Whether the host tier has a budget: something on NVMe and no shard living on the host."""
    tiers = (_device(config, "offload_param"), _device(config, "offload_optimizer"))
    return "cpu" not in tiers and "nvme" in tiers


def _raise_host_budget(config: dict, extra_bytes: int, why: str) -> Change:
    current = _zero(config)["host_budget_bytes"]
    return Change("zero_optimization.host_budget_bytes", current, current + max(extra_bytes, current // 2), why)


def host_budget_change(config: dict, extra_bytes: int, why: str) -> Change | None:
    """A larger explicit `host_budget_bytes`; None when the host budget is not explicit."""
    if _zero(config).get("host_budget_bytes") is None:
        return None
    return _raise_host_budget(config, extra_bytes, why)


def read_ahead_change(config: dict, largest_shard_bytes: int) -> Change | None:
    """The setting that keeps more NVMe parameter shards in host memory, with a value that does; None when
    parameters are not on NVMe."""
    if _device(config, "offload_param") != "nvme":
        return None
    z = _zero(config)
    if z.get("host_budget_bytes") is not None:
        return _raise_host_budget(config, 4 * largest_shard_bytes, "the host budget is explicit")
    if not host_bounded(config):
        return Change(
            "zero_optimization.offload_param.device", "nvme", "cpu", "host memory is unbounded: if the parameters fit"
        )
    p = z["offload_param"]
    floor = 4 * math.ceil(largest_shard_bytes / itemsize(config))
    count, size, cap = p["buffer_count"], p["buffer_size"], p.get("max_in_cpu")

    def read_ahead(count: int, cap: int | None) -> int:  # elements, as plan_memory sizes it
        return max(min(count * size, count * size if cap is None else cap), floor)

    now = read_ahead(count, cap)
    target = 2 * now
    more_buffers, more_cap = math.ceil(target / size), max(cap or 0, target)
    by_count, by_cap = read_ahead(more_buffers, cap), read_ahead(count, more_cap)
    key = "zero_optimization.offload_param."
    if by_count > now and by_count >= by_cap:
        return Change(key + "buffer_count", count, more_buffers)
    if by_cap > now:
        return Change(key + "max_in_cpu", cap, more_cap)
    return Change(key + "buffer_count", count, more_buffers, also=((key + "max_in_cpu", more_cap),))


def optimizer_window_change(config: dict, largest_shard_bytes: int) -> Change | None:
    """The setting that lets the NVMe optimizer hold more shards in flight; None when it is not on NVMe."""
    if _device(config, "offload_optimizer") != "nvme":
        return None
    z = _zero(config)
    if z.get("host_budget_bytes") is not None and host_bounded(config):
        elems = math.ceil(largest_shard_bytes / itemsize(config))
        return _raise_host_budget(config, 2 * 16 * elems, "the host budget caps the window")
    count = z["offload_optimizer"]["buffer_count"]
    return Change("zero_optimization.offload_optimizer.buffer_count", count, 2 * count)


def prefetch_change(config: dict, world_size: int, block_elems: int) -> Change | None:
    """A larger prefetch bucket; None where no block is gathered (stages 1-2; one rank, parameters on the
    device)."""
    if _zero(config).get("stage", 3) < 3 or (world_size == 1 and _device(config, "offload_param") == "none"):
        return None
    current = _zero(config).get("stage3_prefetch_bucket_size", 0)
    return Change("zero_optimization.stage3_prefetch_bucket_size", current, max(2 * current, 2 * block_elems))


def aio_change(config: dict, high_queue_depth: int, high_intra_op: int) -> Change | None:
    """More requests in flight (queue depth, then threads, then larger requests); None without NVMe."""
    if "nvme" not in (_device(config, "offload_param"), _device(config, "offload_optimizer")):
        return None
    aio = config.get("aio") or {}
    depth, intra, block = aio.get("queue_depth", 8), aio.get("intra_op_parallelism", 1), aio.get("block_size", 1 << 20)
    if depth < high_queue_depth:
        return Change("aio.queue_depth", depth, 2 * depth)
    if intra < high_intra_op:
        return Change("aio.intra_op_parallelism", intra, 2 * intra)
    if block < AIO_BLOCK_MAX:
        return Change("aio.block_size", block, min(4 * block, AIO_BLOCK_MAX))
    return None
