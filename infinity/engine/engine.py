"""InfinityEngine: wires placement, shard store, optimizer and scheduler into forward/backward/step.

The constructor is a list of wiring steps, each a function with explicit arguments (torchtitan's
`parallelize` style): resolve the config and the placement policy, plan blocks and memory, open the
tiers and the shard store, shard the model into it, build the optimizer and the hooks.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from infinity.comm import CommGroup, bind_compute_device, comm_device, init_distributed
from infinity.comm.heartbeat import end_on_silence, start_heartbeat
from infinity.config import InfinityConfig, load_config, no_effect_notices, resolve_auto, resolve_batch_sizes
from infinity.engine.grad_reduction import GradReducer, GradScaling, share_updated_partitions
from infinity.engine.host_memory import limit_freed_memory
from infinity.engine.inputs import move_inputs
from infinity.engine.memory_plan import MemoryPlan, check_host_budget, home_bytes, plan_memory
from infinity.engine.param_groups import plan_groups
from infinity.engine.sharding import shard_model
from infinity.optim.loss_scaler import LossScaler
from infinity.optim.lr_schedules import build_schedule
from infinity.optim.sharded_adam import ShardedAdam
from infinity.partition import plan_blocks
from infinity.partition.materialize import check_materializable
from infinity.partition.sharded_block import ShardedBlock
from infinity.profiler.null_writer import NullTraceWriter
from infinity.profiler.wall_clock import WallClock
from infinity.profiler.writer import open_trace_writer
from infinity.scheduler import BlockScheduler
from infinity.scheduler.unused_params import UnusedParameterCheck
from infinity.shards import MallocTuning, Placement, ShardStore, resolve_placement
from infinity.shards.registry import owner_of
from infinity.storage import MoveCounter, Recorder, Tier, TierStore, check_free_space, swap_file_bytes


def compute_device() -> torch.device:
    """This rank's compute device, bound as the current CUDA device (see `bind_compute_device`)."""
    return bind_compute_device()


def _hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _check_model(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if owner_of(p) is not None:
            raise ValueError(
                f"this model is already wrapped by an infinity engine (its parameter '{name}' is sharded); pass "
                "the original model only once, or close() the other engine first"
            )
    if any(p.is_meta for p in model.parameters()):
        check_materializable(model)


def apply_process_settings(placement: Placement) -> None:
    """Process-wide settings the placement calls for: CPU float hygiene, malloc's freed memory."""
    if placement.compute_device.type == "cpu":
        torch.set_flush_denormal(True)  # decaying weights in denormals slow CPU steps several-fold
    if placement.malloc is not MallocTuning.NONE:
        limit_freed_memory(return_to_os=placement.malloc is MallocTuning.RETURN_TO_OS)  # see host_memory


def _open_tiers(
    cfg: InfinityConfig, memory: MemoryPlan, nvme_bytes: int, rank: int, device: torch.device, recorder: Recorder
) -> TierStore:
    """The tier store, its swap file sized to this rank's NVMe slots after checking that the disk holds
    every local rank's (they share the nvme_path)."""
    z = cfg.zero_optimization
    sections = (z.offload_param, z.offload_optimizer)
    path = next((s.nvme_path for s in sections if s.device == "nvme" and s.nvme_path), None)
    if path is not None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        check_free_space(path, local_ranks * swap_file_bytes(nvme_bytes), f"{local_ranks} rank(s)' swap files")
    return TierStore.from_config(
        z.offload_param,
        z.offload_optimizer,
        cfg.aio,
        memory.budgets,
        rank=rank,
        device=device,
        recorder=recorder,
        expected_nvme_bytes=nvme_bytes,
    )


def seed_everything(seed: int) -> None:
    """The config's `seed`: Python's, numpy's and torch's generators (every device's) on this rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = buf.to(device)


class InfinityEngine:
    """A ZeRO model (stage 3, or 1 and 2 with replicated parameters): call it like the module, then
    `backward(loss)` and `step()`."""

    def __init__(
        self,
        model: nn.Module,
        config: InfinityConfig | dict | str | None,
        model_parameters: Iterable | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
    ) -> None:
        _check_model(model)
        cfg = load_config(config)
        device = compute_device()
        rank, world = init_distributed(device, cfg.zero_optimization.comm_timeout_s)
        group = dist.group.WORLD if world > 1 else None
        self.comm = CommGroup(rank, world, group, device=comm_device(device, group))
        # a stopped peer ends the run after heartbeat_timeout_s, not comm_timeout_s (unless the caller,
        # such as `infinity train`, watches the peers already)
        self._heartbeat = start_heartbeat(rank, world, cfg.zero_optimization.heartbeat_timeout_s, end_on_silence)
        self.config = cfg = resolve_auto(resolve_batch_sizes(cfg, world), _hidden_size(model))
        if cfg.seed is not None:
            seed_everything(cfg.seed)  # before a meta model is materialized with its initializers
        if rank == 0:
            for line in no_effect_notices(cfg):
                print(line, file=sys.stderr)
        z = cfg.zero_optimization
        self.placement = resolve_placement(cfg, device, world, client_optimizer=optimizer is not None)
        apply_process_settings(self.placement)
        self.module = model
        self.global_steps = 0
        self.micro_steps = 0
        self.loss_scaler = LossScaler(cfg.fp16)
        _move_buffers(model, device)

        groups = plan_groups(model, cfg.optimizer, model_parameters, optimizer)
        plan = plan_blocks(model, z.block_classes, z.block_size_elems, z.stage3_param_persistence_threshold)
        memory = plan_memory(z, plan, self.placement, groups.group_of)
        homes = home_bytes(plan, groups.group_of, self.placement, cfg.gradient_accumulation_steps, z.sub_group_size)
        check_host_budget(z, homes)
        self.nvme_bytes_planned = homes[Tier.NVME]
        self.prof = open_trace_writer(cfg, rank, world) or NullTraceWriter()
        self.moves = MoveCounter(forward=self.prof)  # the bytes that moved between tiers, for bytes_moved
        self.tiers = _open_tiers(cfg, memory, self.nvme_bytes_planned, rank, device, self.moves)
        self.shards = ShardStore(
            self.tiers,
            self.placement,
            self.comm,
            read_ahead_bytes=memory.param_read_ahead_bytes,
            grad_writes_in_flight=memory.optimizer_window // 2,  # as many as arrivals hold (memory_plan)
        )
        self.optimizer = ShardedAdam(
            groups.groups,
            groups.adamw_mode,
            self.shards,
            memory.optimizer_window,
            self.prof,
            pipeline=(z.offload_optimizer.pipeline_read, z.offload_optimizer.pipeline_write),
        )
        self.blocks, self.root, self.persistent = shard_model(
            model, plan, groups.group_of, self.shards, self.comm, z.sub_group_size
        )
        self.reducer = GradReducer(
            self.comm,
            self.optimizer,
            self.placement.grad_reduction,
            self.placement.reduce_dtype,
            overlap=z.overlap_comm,
            bucket_elems=z.reduce_bucket_size,
            prof=self.prof,
            scaling=GradScaling.from_config(cfg.prescale_gradients, cfg.gradient_predivide_factor, world),
        )
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.wall_clock = WallClock(cfg.wall_clock_breakdown, cfg.steps_per_print, rank, sync)
        self._unused_check = None if z.ignore_unused_parameters else UnusedParameterCheck(model, self.comm, device)

        self._client_optimizer = optimizer
        self.lr_scheduler = self._make_lr_scheduler(lr_scheduler)
        # With a client optimizer, its param groups are the hyper-parameters' source of truth unless the
        # engine's own schedule (from the config, or built on the returned optimizer) drives them.
        on_client = getattr(self.lr_scheduler, "optimizer", None) is optimizer
        self._client_is_truth = optimizer is not None and (self.lr_scheduler is None or on_client)
        if optimizer is not None and not self._client_is_truth:
            self._sync_hyperparameters(into_client=True)
        self.scheduler = BlockScheduler(
            model,
            self.blocks,
            self.root,
            self.persistent,
            self.shards,
            self._reduce_block_grads,
            prefetch_bucket_elems=z.stage3_prefetch_bucket_size,
            max_live_elems=z.stage3_max_live_parameters,
            max_reuse_distance_elems=z.stage3_max_reuse_distance,
            gather_waits_on=self.placement.gather_waits_on,
            collectives=world > 1,
            prof=self.prof,
        )
        self.moves.reset()  # bytes_moved counts training's moves, not the shards' first placement

    @property
    def flats(self):
        return self.shards.flats

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.placement.compute_dtype

    @property
    def device(self) -> torch.device:
        return self.placement.compute_device

    def _make_lr_scheduler(self, lr_scheduler: Any):
        if lr_scheduler is not None:
            return (
                lr_scheduler(self.optimizer)
                if callable(lr_scheduler) and not hasattr(lr_scheduler, "step")
                else (lr_scheduler)
            )
        if self.config.scheduler is not None:
            return build_schedule(self.config.scheduler.type, self.optimizer, self.config.scheduler.params)
        return None

    # -- gradients -----------------------------------------------------------------------------

    def _reduce_block_grads(self, block: ShardedBlock) -> None:
        self.reducer.reduce_block(block, self.is_gradient_accumulation_boundary())

    # -- the training API ----------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Run the module; tensors among the inputs in CPU memory move to the compute device first (`inputs`)."""
        if self.micro_steps % self.gradient_accumulation_steps == 0 and self.scheduler.phase.value == "idle":
            self.prof.begin_step(self.global_steps)
            for tier in Tier:  # each step's peak is its own
                self.tiers.reset_high_water(tier)
        self.prof.set_phase("forward")
        args, kwargs = move_inputs(args, kwargs, self.device)
        with self.wall_clock.time("forward"):
            return self.module(*args, **kwargs)

    def _record_live_bytes(self) -> None:
        for tier in Tier:
            self.prof.live(tier.value, self.tiers.live_bytes(tier))

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (scaled by 1/gradient_accumulation_steps and the fp16 loss scale)."""
        scaled = loss * (self.loss_scaler.scale / self.gradient_accumulation_steps)
        self.shards.settle_all()  # a step still owed (a shard the forward did not gather) before new gradients
        self.scheduler.begin_backward()
        self.prof.set_phase("backward")
        self._record_live_bytes()
        with self.wall_clock.time("backward"):
            scaled.backward()
            self.scheduler.finish_backward()
            self.reducer.flush()

    def step(self) -> None:
        """At an accumulation boundary: clip, unscale, step the optimizer and the LR schedule."""
        if self.is_gradient_accumulation_boundary():
            if self._unused_check is not None:
                self._unused_check.check()
            self.prof.set_phase("optimizer")
            self._record_live_bytes()
            with self.wall_clock.time("step"):
                self._optimizer_step()
            self._record_live_bytes()
            for tier in Tier:
                self.prof.peak(tier.value, self.tiers.high_water_bytes(tier))
            self.prof.end_step(self.global_steps - 1)
            self.wall_clock.end_step(self.global_steps)
        self.micro_steps += 1

    def _sync_hyperparameters(self, into_client: bool) -> None:
        """Copy lr, betas, eps and weight decay between the client optimizer's groups and the engine's."""
        if self._client_optimizer is None:
            return
        for client, mine in zip(self._client_optimizer.param_groups, self.optimizer.param_groups, strict=True):
            src, dst = (mine, client) if into_client else (client, mine)
            for key in ("lr", "betas", "eps", "weight_decay"):
                dst[key] = src[key]

    def _optimizer_step(self) -> None:
        self.reducer.flush()  # reductions still in flight (a backward run without engine.backward)
        if self._client_is_truth:
            self._sync_hyperparameters(into_client=False)
        clip = self.config.gradient_clipping
        scale = self.loss_scaler.scale
        coef = 1.0
        if self.placement.needs_grad_norm:
            norm_sq = self.optimizer.local_grad_norm_sq().to(self.device)
            start = time.perf_counter_ns()
            self.comm.all_reduce(norm_sq, "gradient norm")
            if self.comm.world_size > 1:
                self.prof.collective("all-reduce", "<norm>", norm_sq.element_size(), start, time.perf_counter_ns())
            norm = math.sqrt(norm_sq.item()) / scale if math.isfinite(norm_sq.item()) else math.inf
            self.last_grad_norm = norm
            if self.loss_scaler.update(overflow=not math.isfinite(norm)):
                self.optimizer.zero_grad()
                self.global_steps += 1
                return
            coef = ShardedAdam.clip_coefficient(norm, clip)
        self.optimizer.step(grad_scale=coef / scale, order=self._forward_order())
        self.optimizer.zero_grad()
        share_updated_partitions(self.shards, self.config.zero_optimization.allgather_bucket_size, self.prof)
        self.persistent.reshard()  # its gathered copy is stale: re-gathered at the next forward
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
            self._sync_hyperparameters(into_client=not self._client_is_truth)
        self.global_steps += 1

    def _forward_order(self) -> list:
        """The flats in the order the next forward gathers them: persistent and root first, then the blocks
        as the last forward ran them (module order for those it did not run)."""
        seen = dict.fromkeys(self.scheduler.forward_trace.order)
        seen.update(dict.fromkeys(range(len(self.blocks))))
        return [*self.persistent.flats, *self.root.flats, *(f for i in seen for f in self.blocks[i].flats)]

    @property
    def bytes_moved(self) -> dict[str, int]:
        """Bytes that moved between tiers since initialization, per "from->to" pair: parameter shards,
        optimizer state and gradients as the store moved them (cache hits move nothing), and gradients
        copied off the device."""
        moved = dict(self.moves.bytes)
        if self.shards.grad_bytes_to_host:
            moved["device->host"] = moved.get("device->host", 0) + self.shards.grad_bytes_to_host
        return moved

    @property
    def stall_s(self) -> float:
        """Seconds compute waited for a block's weights to arrive."""
        return self.scheduler.stall_s

    def close(self) -> None:
        """Release the engine's storage (the NVMe swap files are removed); call once training is done."""
        self.optimizer.stepper.drain(raise_errors=False)  # a failed write-behind: its swap file goes anyway
        self.scheduler.remove_hooks()
        if self._unused_check is not None:
            self._unused_check.remove()
        self.shards.close()
        self.prof.close()
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    destroy = close  # DeepSpeed's name

    def train(self, mode: bool = True) -> InfinityEngine:
        self.module.train(mode)
        return self

    def eval(self) -> InfinityEngine:
        return self.train(False)

    def get_lr(self) -> list[float]:
        if self._client_is_truth:
            self._sync_hyperparameters(into_client=False)
        return [g["lr"] for g in self.optimizer.param_groups]

    @property
    def skipped_steps(self) -> int:
        return self.loss_scaler.skipped_steps

    # -- state in and out: checkpoints and full weights ----------------------------------------

    def save_checkpoint(
        self, save_dir: str, tag: str | None = None, client_state: dict | None = None, save_latest: bool = True
    ) -> str:
        """Write a sharded checkpoint (every rank calls this); returns its folder."""
        from infinity.engine.checkpoint import save_checkpoint

        self.optimizer.refuse_mid_step("save_checkpoint")
        tag = tag or f"global_step{self.global_steps}"
        folder = save_checkpoint(
            save_dir, tag, self.shards, self.module, self._run_state(), client_state or {}, save_latest
        )
        if self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            self.save_16bit_model(str(folder))  # as HF's Trainer does at each save with this key set
        return str(folder)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's: the consolidated compute-dtype weights in save_dir/save_filename when
        `stage3_gather_16bit_weights_on_model_save` is set (True), else nothing (False); every rank calls it."""
        from infinity.engine.weights16 import save_16bit_model

        self.optimizer.refuse_mid_step("save_16bit_model")
        enabled = self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save
        return save_16bit_model(self.shards, self.module, enabled, save_dir, save_filename)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str, dict]:
        """Restore a checkpoint written by `save_checkpoint`; returns (its folder, the client state)."""
        from infinity.engine.checkpoint import load_checkpoint

        self.optimizer.refuse_mid_step("load_checkpoint")
        optimizer_too = load_optimizer_states and not load_module_only
        folder, client_state, saved = load_checkpoint(
            load_dir,
            tag,
            self.shards,
            self.module,
            optimizer_too,
            restore_rng=not load_module_only,
            elastic=self.config.zero_optimization.elastic_checkpoint,
        )
        if optimizer_too:
            for group, saved_group in zip(self.optimizer.param_groups, saved.param_groups, strict=True):
                group.update(saved_group)
        if not load_module_only:
            self.global_steps, self.micro_steps = saved.global_steps, saved.micro_steps
            self.loss_scaler.load_state_dict(saved.loss_scaler)
        if load_lr_scheduler_states and not load_module_only and self.lr_scheduler is not None:
            if saved.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(saved.lr_scheduler)
        self.persistent.reshard()  # re-gathered from the restored shards at the next forward
        return str(folder), client_state

    def _run_state(self):
        from infinity.engine.checkpoint import RunState

        return RunState(
            global_steps=self.global_steps,
            micro_steps=self.micro_steps,
            loss_scaler=self.loss_scaler.state_dict(),
            lr_scheduler=self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            param_groups=[{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
        )

    def iter_full_state(self):
        """Yield (name, full fp32 CPU tensor) block by block; every rank must iterate it to the end."""
        from infinity.engine.state_io import iter_full_state

        self.optimizer.refuse_mid_step("reading the optimizer state (a checkpoint, full weights)")
        return iter_full_state(self.shards, self.module)

    def load_full_state(self, source, strict: bool = True) -> list[str]:
        """Load pretrained weights (a state dict, a torch file or a folder of safetensors), block by block."""
        from infinity.engine.state_io import load_full_state

        self.optimizer.refuse_mid_step("load_full_state")
        return load_full_state(self.shards, self.module, source, strict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from infinity.engine.state_io import full_state_dict

        self.optimizer.refuse_mid_step("reading the optimizer state (a checkpoint, full weights)")
        return full_state_dict(self.shards, self.module)
