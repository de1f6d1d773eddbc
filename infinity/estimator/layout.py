"""The bytes one ZeRO stage and offload choice needs per device, per node in host memory and on NVMe.

The byte layout is the engine's (`engine.memory_plan.home_bytes`, `shards.policy.resolve_placement`):
see the package docstring for the rules, which this module is the arithmetic of.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infinity.estimator.sizes import ModelSize
from infinity.partition.flat_param import SHARD_ALIGN_ELEMS, FlatParam
from infinity.shards.moments import moment_format
from infinity.storage import ALIGN

OFFLOADS = ("none", "cpu", "nvme")
OFFLOAD_CHOICES: tuple[tuple[str, str], ...] = (
    ("none", "none"),
    ("none", "cpu"),
    ("cpu", "cpu"),
    ("none", "nvme"),
    ("cpu", "nvme"),
    ("nvme", "nvme"),
)  # (offload_param, offload_optimizer) at stage 3: the optimizer is offloaded at least as far as the parameters
STAGE_CHOICES: tuple[tuple[int, str, str], ...] = (
    *((stage, "none", optim) for stage in (1, 2) for optim in OFFLOADS),
    *((3, param, optim) for param, optim in OFFLOAD_CHOICES),
)  # (stage, offload_param, offload_optimizer): stages 1-2 keep the parameters on the device


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes one stage and offload choice needs: per device, and per node in host memory and on NVMe."""

    offload_param: str
    offload_optimizer: str
    device_bytes: int
    host_bytes: int
    nvme_bytes: int
    stage: int = 3
    moments: str = "fp32"


@dataclass(frozen=True)
class _Choice:
    """One estimate's inputs besides the model, validated."""

    stage: int
    offload_param: str
    offload_optimizer: str
    ranks: int
    dtype_bytes: int
    moments: str
    grads_wait: bool  # the step cannot run as a shard's final gradient arrives: an NVMe accumulator slot
    device_is_host: bool
    grad_bytes: int = 4  # per element of that NVMe slot (`Placement.grad_dtype`)
    grads_in_host: bool = False  # those gradients wait in host memory instead (`memory_plan.grads_wait_in_host`)

    @property
    def resident(self) -> bool:
        """Whole flats live where the compute reads them (`Placement.params_resident`)."""
        in_compute_memory = self.offload_param == "none" or (self.offload_param == "cpu" and self.device_is_host)
        return in_compute_memory and (self.stage < 3 or self.ranks == 1)

    @property
    def master_is_param(self) -> bool:
        """fp32 with the master and the parameter shard on one tier: one slot (`Placement.master_is_param`)."""
        if self.dtype_bytes != 4:
            return False
        if self.offload_param == "nvme" or self.offload_optimizer == "nvme":
            return self.offload_param == self.offload_optimizer
        return self._memory(self.offload_param) == self._memory(self.offload_optimizer)

    def _memory(self, offload: str) -> str:
        return "host" if offload == "cpu" or self.device_is_host else "device"


def _slot(nbytes: int, offload: str) -> int:
    """A slot's bytes in its tier: host buffers and the swap file pad each slot to 4 KiB."""
    return nbytes if offload == "none" else -(-nbytes // ALIGN) * ALIGN


def _param_slot(elems: int, c: _Choice) -> int:
    """Bytes on the `offload_param` tier one rank's parameter slot of a flat of `elems` takes (all a frozen
    flat has: no master, moments or gradient)."""
    shard = FlatParam.shard_elems(elems, c.ranks)
    return _slot((shard * c.ranks if c.resident else shard) * c.dtype_bytes, c.offload_param)


def _flat_homes(elems: int, c: _Choice) -> dict[str, int]:
    """Bytes per offload tier ("none" is the device) one rank's slots of one trainable flat take."""
    shard = FlatParam.shard_elems(elems, c.ranks)
    homes = dict.fromkeys(OFFLOADS, 0)
    homes[c.offload_param] += _param_slot(elems, c)
    optim = c.offload_optimizer
    if not c.master_is_param:
        homes[optim] += _slot(4 * shard, optim)
    homes[optim] += _slot(moment_format(c.moments).state_bytes(shard), optim)
    if optim == "nvme" and c.grads_wait and c.grads_in_host:
        homes["cpu"] += c.grad_bytes * shard  # a plain tensor while it waits
    elif optim != "nvme" or c.grads_wait:
        homes[optim] += _slot((c.grad_bytes if optim == "nvme" else 4) * shard, optim)
    return homes


def _homes(size: ModelSize, c: _Choice) -> dict[str, int]:
    total = dict.fromkeys(OFFLOADS, 0)
    for elems, count in size.flat_counts():
        for tier, nbytes in _flat_homes(elems, c).items():
            total[tier] += count * nbytes
    for elems, count in size.frozen_flat_counts():
        total[c.offload_param] += count * _param_slot(elems, c)
    return total


def _choice(
    stage: int,
    offload_param: str,
    offload_optimizer: str,
    ranks: int,
    dtype_bytes: int,
    moments: str,
    clip: bool,
    accumulation: int,
    device_is_host: bool,
    grads_in_host: bool = False,
) -> _Choice:
    """The validated inputs; ValueError naming the argument and the fix, as the config would refuse them."""
    if stage not in (1, 2, 3):
        raise ValueError(f"stage={stage}: infinity implements ZeRO stages 1, 2 and 3")
    for name, value in (("offload_param", offload_param), ("offload_optimizer", offload_optimizer)):
        if value not in OFFLOADS:
            raise ValueError(f"{name}={value!r}: choose one of {', '.join(OFFLOADS)}")
    if stage < 3 and offload_param != "none":
        raise ValueError(f"offload_param={offload_param!r} at stage {stage}: parameters are offloaded at stage 3 only")
    moment_format(moments)  # names the formats when it is none of them
    if moments != "fp32" and offload_optimizer == "none":
        raise ValueError(f"moments={moments!r} with offload_optimizer='none': compressed moments are stepped by "
                         "the native CPU Adam only; offload the optimizer to 'cpu' or 'nvme', or use fp32")  # fmt: skip
    if ranks < 1 or accumulation < 1 or dtype_bytes not in (2, 4):
        raise ValueError(f"ranks={ranks} and accumulation={accumulation} must be >= 1, dtype_bytes={dtype_bytes} "
                         "2 (bf16/fp16) or 4 (fp32)")  # fmt: skip
    # On NVMe the step runs as each shard's final gradient arrives, its gradient never written, unless it must
    # wait for the global norm (clipping, fp16) or micro-batches accumulate (shards.policy.StepTiming), or the
    # gradients can wait in host memory: a run without a budget then defers the step to balance its I/O
    # (engine.memory_plan.balance_step_timing).
    grads_wait = clip or accumulation > 1 or grads_in_host
    # one micro-batch's gradient waits in the compute dtype (communication_data_type at its default)
    grad_bytes = dtype_bytes if accumulation == 1 else 4
    return _Choice(
        stage,
        offload_param,
        offload_optimizer,
        ranks,
        dtype_bytes,
        moments,
        grads_wait,
        device_is_host,
        grad_bytes,
        grads_in_host,
    )


def estimate(
    size: ModelSize,
    offload_param: str,
    offload_optimizer: str,
    gpus_per_node: int = 1,
    nodes: int = 1,
    dtype_bytes: int = 2,
    param_buffer_elems: int = 5 * 100_000_000,
    optimizer_window: int = 4,
    *,
    stage: int = 3,
    moments: str = "fp32",
    clip: bool = True,
    accumulation: int = 1,
    device_is_host: bool = False,
    grads_in_host: bool = False,
) -> MemoryNeed:
    """The bytes `size` needs at ZeRO `stage` with these offload devices ("none", "cpu" or "nvme"), Adam's
    moments in `moments` ("fp32", "bf16", "8bit"), gradient clipping on or off (`clip`; fp16 counts as
    on: its overflow check needs the same global norm), `accumulation` micro-batches per step, the
    device's memory being host memory (`device_is_host`: no CUDA), and gradients that wait for an NVMe
    optimizer's step held in host memory (`grads_in_host`: a run without `host_budget_bytes` where they fit,
    `engine.memory_plan.grads_wait_in_host`). See the package docstring."""
    if gpus_per_node < 1 or nodes < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node} and nodes={nodes} must both be >= 1")
    ranks = gpus_per_node * nodes
    c = _choice(stage, offload_param, offload_optimizer, ranks, dtype_bytes, moments, clip, accumulation,
                device_is_host, grads_in_host)  # fmt: skip
    homes = _homes(size, c)
    block = size.largest_block_params
    block_shard = math.ceil(block / ranks) + SHARD_ALIGN_ELEMS  # memory_plan.largest_shard_elems
    flat_shard = FlatParam.shard_elems(size.largest_flat_params, ranks)
    staging = 0
    if offload_param == "nvme":  # the parameters' read-ahead (offload_param buffer_count x buffer_size)
        staging += dtype_bytes * max(param_buffer_elems, 4 * block_shard)
    if offload_optimizer == "nvme":  # the gradient read-modify-write, and window + 1 shards' state in flight
        state = 8 * flat_shard + moment_format(moments).state_bytes(flat_shard)
        staging += 4 * flat_shard + (max(1, optimizer_window) + 1) * state
    # the running block's gradients in the compute dtype, and their reduction's buffer (communication_data_type
    # defaults to it); at stage 3, unless the flats are resident, the running and the prefetched block's weights
    working = 2 * dtype_bytes * block + (0 if c.resident else 2 * dtype_bytes * block)
    return MemoryNeed(
        offload_param,
        offload_optimizer,
        device_bytes=working + homes["none"],
        host_bytes=gpus_per_node * (homes["cpu"] + staging),
        nvme_bytes=gpus_per_node * homes["nvme"],
        stage=stage,
        moments=moments,
    )


def home_bytes_per_rank(
    size: ModelSize,
    offload_param: str,
    offload_optimizer: str,
    ranks: int = 1,
    dtype_bytes: int = 2,
    *,
    stage: int = 3,
    moments: str = "fp32",
    clip: bool = True,
    accumulation: int = 1,
    device_is_host: bool = False,
    grads_in_host: bool = False,
) -> dict[str, int]:
    """Bytes per offload tier ("none": the device, "cpu", "nvme") that one rank's shard slots take in their
    homes, staging and working sets left out: what `engine.memory_plan.home_bytes` says for the same run."""
    c = _choice(stage, offload_param, offload_optimizer, ranks, dtype_bytes, moments, clip, accumulation,
                device_is_host, grads_in_host)  # fmt: skip
    return _homes(size, c)


def host_resident_bytes(
    size: ModelSize,
    offload_param: str,
    offload_optimizer: str,
    ranks: int = 1,
    dtype_bytes: int = 2,
    **choice,
) -> int:
    """Bytes per rank of the model states whose home is host memory (the "cpu" offloads), NVMe staging
    left out: the least a `zero_optimization.host_budget_bytes` must hold for them. `choice`: stage,
    moments, clip, accumulation, device_is_host as for `estimate`."""
    return home_bytes_per_rank(size, offload_param, offload_optimizer, ranks, dtype_bytes, **choice)["cpu"]
