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


class StepTiming(enum.Enum):
    """When a shard's optimizer step runs (the native stepper's shards; the torch stepper's run after backward)."""

    AFTER_BACKWARD = "after-backward"  # all shards, once backward and the global norm are done
    DURING_BACKWARD = "during-backward"  # each shard as its final gradient arrives (nothing global to wait for)
    BEFORE_NEXT_GATHER = "before-next-gather"  # each shard just before the next forward gathers it (or, resident,
    # runs its block), its I/O overlapping that forward: the step needs the global norm (clipping, fp16) or
    # hyper-parameters set at step time (a client optimizer), so it cannot run during backward


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
    reduce_dtype: torch.dtype  # gradients cross ranks in it (`communication_data_type`), summed in fp32 after
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
    step_timing: StepTiming
    needs_grad_norm: bool  # gradient clipping or fp16's overflow check needs the global norm before a step
    malloc: MallocTuning
    moments: str = "fp32"  # the format Adam's moments are stored in (`shards.moments`)
    grad_dtype: torch.dtype = torch.float32  # a gradient waiting on NVMe for its step is stored in this

    @property
    def step_in_backward(self) -> bool:
        return self.step_timing is StepTiming.DURING_BACKWARD

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
    cfg: InfinityConfig, compute_device: torch.device, world_size: int, client_optimizer: bool, defer_step: bool = False
) -> Placement:
    """The policy for `cfg` (batch sizes and "auto" already resolved) on this machine and world size.
    `defer_step`: the native stepper's step runs just before the next gather even where it could run during
    backward (the engine's choice: `memory_plan.balance_step_timing`)."""
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
    both_on_nvme = param_home is Tier.NVME and optim_home is Tier.NVME
    # fp32: the master is the parameter shard wherever both live together (memory, or one NVMe slot)
    master_is_param = dtype == torch.float32 and (both_on_nvme or (param_home is not Tier.NVME and same_memory))
    stepper = StepperKind.TORCH if optim_home is Tier.DEVICE else StepperKind.NATIVE
    fp16 = cfg.fp16.enabled is True
    needs_norm = cfg.gradient_clipping > 0 or fp16
    step_timing = StepTiming.AFTER_BACKWARD
    # The native stepper moves state over a link slower than the compute (NVMe; host memory under a GPU):
    # its shards are stepped where that traffic overlaps compute. With nothing global to wait for (a
    # clipping norm, an overflow check, a client optimizer's hyper-parameters set at step time), during
    # backward (unless the engine chose `defer_step`); otherwise just before the next forward gathers each
    # shard. Resident parameters are never gathered: their block's pre-forward settles the step instead,
    # where the host computes from them (the step writes them in place) and no other update is owed to them
    # (stages 1-2 share partitions then).
    overlap = stepper is StepperKind.NATIVE and (optim_home is Tier.NVME or compute_device.type == "cuda")
    settle_resident = resident and host_is_compute and world_size == 1
    deferrable = not resident or settle_resident
    if overlap and not needs_norm and not client_optimizer and not (defer_step and deferrable):
        step_timing = StepTiming.DURING_BACKWARD
    elif overlap and deferrable:
        step_timing = StepTiming.BEFORE_NEXT_GATHER
    malloc = MallocTuning.NONE
    if compute_device.type == "cpu" and Tier.NVME in (param_home, optim_home):
        malloc = MallocTuning.RETURN_TO_OS if z.host_budget_bytes is not None else MallocTuning.CAP_ARENAS
    reduction = GradReduction.ALL_REDUCE if z.stage == 1 else GradReduction.REDUCE_SCATTER
    comm_dtype = cfg.communication_data_type
    reduce_dtype = (
        dtype if comm_dtype is None else {"fp32": torch.float32, "fp16": torch.float16}.get(comm_dtype, torch.bfloat16)
    )
    # A gradient that waits on NVMe for the step is kept in the compute dtype where that loses nothing: one
    # micro-batch (no sum carried in fp32), reduced in the compute dtype or not reduced at all (one rank).
    grad_dtype = torch.float32
    grads_wait_on_nvme = optim_home is Tier.NVME and step_timing is not StepTiming.DURING_BACKWARD
    single_batch = cfg.gradient_accumulation_steps == 1
    if grads_wait_on_nvme and dtype != torch.float32 and single_batch and (reduce_dtype == dtype or world_size == 1):
        grad_dtype = dtype
    return Placement(
        compute_device=compute_device,
        compute_dtype=dtype,
        reduce_dtype=reduce_dtype,
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
        step_timing=step_timing,
        needs_grad_norm=needs_norm,
        malloc=malloc,
        moments=z.offload_optimizer.moments,
        grad_dtype=grad_dtype,
    )
