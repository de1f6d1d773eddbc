"""The placement policy: where each rank's bytes of a flat parameter live and how a step reaches them.

Decided once, from the config, the compute device and the world size (`resolve_placement`), then
passed to every layer that needs it. Nothing below the engine re-derives it from devices, world sizes
or offload strings: one rank and CPU-only machines are values here, not branches elsewhere.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from infinity.config import InfinityConfig
from infinity.storage import Tier

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def offload_tier(offload_device: str) -> Tier:
    """The tier DeepSpeed's `offload_*.device` names: "none" is the compute device's memory."""
    return {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}[offload_device]


class StepperKind(enum.Enum):
    """Which optimizer pipeline steps the shards."""

    TORCH = "torch"  # torch's fused AdamW over state in device-tier memory
    NATIVE = "native"  # the native CPU Adam over state in host memory or streamed from NVMe


class MallocTuning(enum.Enum):
    """How much freed memory glibc's malloc may keep (see `engine.host_memory`)."""

    NONE = "none"
    CAP_ARENAS = "cap-arenas"  # out-of-core CPU runs: two arenas
    RETURN_TO_OS = "return-to-os"  # ... and an explicit host budget: freed buffers go back at once


@dataclass(frozen=True)
class Placement:
    """Where a rank's bytes live and how they move; see the field comments."""

    compute_device: torch.device
    compute_dtype: torch.dtype
    world_size: int
    param_home: Tier  # the compute-dtype shard between uses
    gather_from: Tier  # where a gather reads the shard: the device tier, or host memory the CPU computes from
    optim_home: Tier  # fp32 master, Adam moments and the gradient accumulator
    params_resident: bool  # the full flat lives permanently where compute reads it; parameters are views of it
    master_is_param: bool  # fp32 compute with master and parameter shard on one tier: one slot serves both
    stepper: StepperKind
    step_in_backward: bool  # a shard is stepped as its final gradient arrives, while backward goes on
    needs_grad_norm: bool  # gradient clipping or fp16's overflow check needs the global norm before a step
    malloc: MallocTuning

    @property
    def compute_in_host_memory(self) -> bool:
        """The compute reads shards straight from host memory (a CPU-only machine without a device pool)."""
        return self.gather_from is Tier.HOST

    @property
    def gather_waits_on(self) -> str:
        """What a gather that was not prefetched waits for first (the profiler's stall label)."""
        if self.param_home is Tier.NVME:
            return "nvme->host"
        if self.param_home is not self.gather_from:
            return "host->device"
        return "all-gather"  # the shard is where gathers read it (one rank: resident, never waited for)


def memory_device(tier: Tier, compute_device: torch.device) -> torch.device | None:
    """The torch device whose memory holds a tier (None for NVMe)."""
    return {Tier.DEVICE: compute_device, Tier.HOST: torch.device("cpu"), Tier.NVME: None}[tier]


def resolve_placement(
    cfg: InfinityConfig, compute_device: torch.device, world_size: int, client_optimizer: bool
) -> Placement:
    """The policy for `cfg` (batch sizes and "auto" already resolved) on this machine and world size."""
    z = cfg.zero_optimization
    dtype = _DTYPES[cfg.compute_dtype_name]
    param_home = offload_tier(z.offload_param.device)
    optim_home = offload_tier(z.offload_optimizer.device)
    # On a CPU-only machine host memory is the compute's own, so a gather reads it in place; given its own
    # `device_budget_bytes`, the device tier stands apart from the host (as on a GPU) and gathers copy into it.
    host_is_compute = compute_device.type == "cpu" and z.device_budget_bytes is None
    gather_from = Tier.HOST if host_is_compute and param_home is not Tier.DEVICE else Tier.DEVICE
    param_memory = memory_device(param_home, compute_device)
    resident = world_size == 1 and param_memory is not None and param_memory == compute_device
    same_memory = param_memory == memory_device(optim_home, compute_device)
    master_is_param = dtype == torch.float32 and param_home is not Tier.NVME and same_memory
    stepper = StepperKind.TORCH if optim_home is Tier.DEVICE else StepperKind.NATIVE
    fp16 = cfg.fp16.enabled is True
    needs_norm = cfg.gradient_clipping > 0 or fp16
    # Nothing global to wait for (a clipping norm, an overflow check, a client optimizer's hyper-parameters
    # set at step time): the NVMe optimizer steps each shard while backward goes on.
    step_in_backward = optim_home is Tier.NVME and not needs_norm and not client_optimizer
    malloc = MallocTuning.NONE
    if compute_device.type == "cpu" and Tier.NVME in (param_home, optim_home):
        malloc = MallocTuning.RETURN_TO_OS if z.host_budget_bytes is not None else MallocTuning.CAP_ARENAS
    return Placement(
        compute_device=compute_device,
        compute_dtype=dtype,
        world_size=world_size,
        param_home=param_home,
        gather_from=gather_from,
        optim_home=optim_home,
        params_resident=resident,
        master_is_param=master_is_param,
        stepper=stepper,
        step_in_backward=step_in_backward,
        needs_grad_norm=needs_norm,
        malloc=malloc,
    )
