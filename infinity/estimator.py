"""How much device, host and NVMe memory the model states need under each offload choice.

In the spirit of DeepSpeed's `estimate_zero3_model_states_mem_needs`, but for infinity's own layout.
With P parameters sharded over N = gpus_per_node x nodes ranks (shard S = ceil(P / N) elements,
largest block shard B = ceil(L / N) for the L elements of the largest block) and b bytes per
compute-dtype weight (2 for bf16/fp16, 4 for fp32):

- parameter shard: b*S bytes on the `offload_param` tier (device / host / NVMe);
- optimizer shard: fp32 master, exp_avg, exp_avg_sq and gradient accumulator, 16*S bytes on the
  `offload_optimizer` tier; in fp32 runs with both shards in one memory tier the master *is* the
  parameter shard, saving 4*S;
- device working set: (3b + 4)*L: the gathered weights of the running and the prefetched block (2b*L),
  the running block's gradients in the compute dtype (b*L) and in fp32 for the reduce-scatter (4*L);
- host staging, per rank, for an NVMe tier: parameters b * max(param_buffer_elems, 4*B) (the
  offload_param buffers, buffer_count x buffer_size elements by default); optimizer
  4 * (4*(window + 1) + 1) * B (the state of `window` + 1 shards in flight, offload_optimizer.buffer_count).

Device figures are per device, host and NVMe figures per node (gpus_per_node ranks). Activations,
the CUDA context and allocator fragmentation are not included: leave headroom for them.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

OFFLOAD_CHOICES: tuple[tuple[str, str], ...] = (
    ("none", "none"),
    ("none", "cpu"),
    ("cpu", "cpu"),
    ("none", "nvme"),
    ("cpu", "nvme"),
    ("nvme", "nvme"),
)  # (offload_param, offload_optimizer): the optimizer is offloaded at least as far as the parameters


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts the estimate needs: all distinct parameters, and those of the largest block."""

    total_params: int
    largest_block_params: int


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes one offload choice needs: per device, and per node in host memory and on NVMe."""

    offload_param: str
    offload_optimizer: str
    device_bytes: int
    host_bytes: int
    nvme_bytes: int


@dataclass(frozen=True)
class Machine:
    """What this machine offers: device memory per device (None without CUDA: the device is the host),
    devices per node, available host memory and free disk at the NVMe path."""

    device_bytes: int | None
    devices: int
    host_bytes: int
    nvme_bytes: int
    nvme_path: str


def size_from_params(total_params: float) -> ModelSize:
    """A GPT-shaped guess of the largest block for a bare parameter count.

    Transformers keep depth near hidden/128 (GPT-3 13B: h=5120, 40 layers), so P ~ 12 h^2 * h/128 and
    the largest block is one layer of 12 h^2 parameters.
    """
    p = int(total_params)
    hidden = (p * 128 / 12) ** (1 / 3)
    return ModelSize(p, min(p, int(12 * hidden * hidden)))


def gpt_model_size(preset: str, **overrides) -> ModelSize:
    """Exact counts for a GPT preset (fields replaced by `overrides`, e.g. block_size), built on the meta
    device (no memory is allocated)."""
    import torch

    from infinity.models.gpt import GPT, gpt_preset

    with torch.device("meta"):
        model = GPT(gpt_preset(preset, **overrides))
    total = sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    root = total - sum(blocks)  # embeddings, final norm and head: the engine's root block
    return ModelSize(total, max([root, *blocks]))


def estimate(
    size: ModelSize,
    offload_param: str,
    offload_optimizer: str,
    gpus_per_node: int = 1,
    nodes: int = 1,
    dtype_bytes: int = 2,
    param_buffer_elems: int = 5 * 100_000_000,
    optimizer_window: int = 4,
) -> MemoryNeed:
    """The bytes `size` needs with these offload devices ("none", "cpu" or "nvme"); see the module doc."""
    if gpus_per_node < 1 or nodes < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node} and nodes={nodes} must both be >= 1")
    ranks = gpus_per_node * nodes
    shard = math.ceil(size.total_params / ranks)
    block = size.largest_block_params
    block_shard = math.ceil(block / ranks)
    tiers = {"none": 0, "cpu": 0, "nvme": 0}  # per-rank bytes by tier ("none" is the device)
    tiers[offload_param] += dtype_bytes * shard
    master_aliases_param = dtype_bytes == 4 and offload_param == offload_optimizer != "nvme"
    tiers[offload_optimizer] += (12 if master_aliases_param else 16) * shard
    staging = 0
    if offload_param == "nvme":
        staging += dtype_bytes * max(param_buffer_elems, 4 * block_shard)
    if offload_optimizer == "nvme":
        staging += 4 * (4 * (max(2, optimizer_window) + 1) + 1) * block_shard
    working = (3 * dtype_bytes + 4) * block
    return MemoryNeed(
        offload_param,
        offload_optimizer,
        device_bytes=working + tiers["none"],
        host_bytes=gpus_per_node * (tiers["cpu"] + staging),
        nvme_bytes=gpus_per_node * tiers["nvme"],
    )


def host_resident_bytes(
    size: ModelSize, offload_param: str, offload_optimizer: str, ranks: int = 1, dtype_bytes: int = 2
) -> int:
    """Bytes per rank of the model states whose home is host memory (the "cpu" offloads), NVMe staging
    left out: the least a `zero_optimization.host_budget_bytes` must hold for them."""
    param = offload_param if offload_param == "cpu" else "none"
    optim = offload_optimizer if offload_optimizer == "cpu" else "none"
    return estimate(size, param, optim, gpus_per_node=1, nodes=ranks, dtype_bytes=dtype_bytes).host_bytes


def fits(need: MemoryNeed, machine: Machine) -> bool:
    """Whether `need` fits `machine`; without CUDA the device tier is host memory too."""
    if machine.device_bytes is None:
        return need.device_bytes * machine.devices + need.host_bytes <= machine.host_bytes and (
            need.nvme_bytes <= machine.nvme_bytes
        )
    return (
        need.device_bytes <= machine.device_bytes
        and need.host_bytes <= machine.host_bytes
        and need.nvme_bytes <= machine.nvme_bytes
    )


def largest_fitting_params(
    machine: Machine, offload_param: str, offload_optimizer: str, nodes: int = 1, dtype_bytes: int = 2
) -> int:
    """The most parameters (GPT-shaped, see `size_from_params`) whose model states fit `machine`; 0 if none."""

    def ok(p: int) -> bool:
        need = estimate(size_from_params(p), offload_param, offload_optimizer, machine.devices, nodes, dtype_bytes)
        return fits(need, machine)

    lo, hi = 0, 1
    while ok(hi) and hi < 10**16:
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 10_000):  # 0.01% is plenty for a capacity estimate
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def available_host_bytes() -> int:
    """Host memory available to a new process (MemAvailable on Linux, else physical memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def probe_machine(nvme_path: str | os.PathLike = ".") -> Machine:
    """This machine's CUDA devices (the smallest one's total memory), available host memory and free disk."""
    import torch

    path = Path(nvme_path)
    while not path.exists() and path != path.parent:
        path = path.parent  # the folder may not exist yet: measure the disk it will be on
    free = shutil.disk_usage(path).free
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        device = min(torch.cuda.get_device_properties(i).total_memory for i in range(count))
        return Machine(device, count, available_host_bytes(), free, str(path))
    return Machine(None, 1, available_host_bytes(), free, str(path))


def format_bytes(n: float) -> str:
    """Decimal units, as disks and `nvidia-smi` count: 1.50 GB, 320.00 MB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_params(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))
