"""The placement policy: where each rank's bytes of a flat parameter live and how a step reaches them.

Decided once, from the config, the compute device and the world size (`resolve_placement`), then
passed to every layer that needs it. Nothing below the engine re-derives it from devices, world sizes
or offload strings: one rank and CPU-only machines are values here, not branches elsewhere.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from infinity.config import ConfigError, InfinityConfig
from infinity.storage import Tier

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def offload_tier(offload_device: str) -> Tier:
    """The tier DeepSpeed's `offload_*.device` names: "none" is the compute device's memory."""
    return {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}[offload_device]


class StepperKind(enum.Enum):
    """Which optimizer pipeline steps the shards."""

    TORCH = "torch"  # torch's fused AdamW over state in device-tier memory
    NATIVE = "native"  # the native CPU Adam over state in host memory or streamed from NVMe


class GradReduction(enum.Enum):
    """How a block's gradients reach this rank's partition."""

    REDUCE_SCATTER = "reduce-scatter"  # stages 2 and 3
    ALL_REDUCE = "all-reduce"  # stage 1: the whole mean on every rank, this rank's slice kept


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
    # the device tier is memory apart from the host's (a GPU; a CPU-only machine given device_budget_bytes):
    # bytes between them cross on the copy stream, gradients in the compute dtype
    device_apart: bool
    world_size: int
    stage: int  # ZeRO stage: 3 partitions parameters; 1 and 2 keep them replicated (and resident)
    grad_reduction: GradReduction
    param_home: Tier  # the compute-dtype shard between uses (stages 1-2: the whole replicated flat)
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
    def grads_cross_to_host(self) -> bool:
        """Gradients computed in device memory are summed in host memory (or on NVMe through it)."""
        return self.device_apart and self.optim_home is not Tier.DEVICE

    @property
    def weights_cross_to_device(self) -> bool:
        """The optimizer steps in host memory and the parameter shard lives in device memory."""
        return self.device_apart and self.param_home is Tier.DEVICE and self.optim_home is not Tier.DEVICE

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
    if z.stage not in (1, 2, 3):
        raise ConfigError(
            f"'zero_optimization.stage' is {z.stage}; infinity implements ZeRO stages 1, 2 and 3 "
            "(stage 0 is plain data parallelism: use torch's DistributedDataParallel)"
        )
    if z.stage < 3 and z.offload_param.device != "none":
        raise ConfigError(
            f"'zero_optimization.offload_param.device' is {z.offload_param.device!r} with stage {z.stage}; "
            "parameters are offloaded at stage 3 only: set the stage to 3, or remove offload_param"
        )
    param_home = offload_tier(z.offload_param.device)
    optim_home = offload_tier(z.offload_optimizer.device)
    # On a CPU-only machine host memory is the compute's own, so a gather reads it in place; given its own
    # `device_budget_bytes`, the device tier stands apart from the host (as on a GPU) and gathers copy into it.
    host_is_compute = compute_device.type == "cpu" and z.device_budget_bytes is None
    gather_from = Tier.HOST if host_is_compute and param_home is not Tier.DEVICE else Tier.DEVICE
    param_memory = memory_device(param_home, compute_device)
    in_compute_memory = param_memory is not None and param_memory == compute_device
    # Stages 1-2 replicate the parameters on every rank; stage 3 keeps them whole only at one rank.
    resident = in_compute_memory and (z.stage < 3 or world_size == 1)
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
    reduction = GradReduction.ALL_REDUCE if z.stage == 1 else GradReduction.REDUCE_SCATTER
    return Placement(
        compute_device=compute_device,
        compute_dtype=dtype,
        device_apart=not host_is_compute,
        world_size=world_size,
        stage=z.stage,
        grad_reduction=reduction,
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
