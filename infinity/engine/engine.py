"""InfinityEngine: wires placement, shard store, optimizer and scheduler into forward/backward/step.

The constructor is a list of wiring steps, each a function with explicit arguments (torchtitan's
`parallelize` style): resolve the config and the placement policy, plan blocks and memory, open the
tiers and the shard store, shard the model into it, build the optimizer and the hooks.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from infinity.comm import CommGroup, comm_device, init_distributed
from infinity.comm.heartbeat import end_on_silence, start_heartbeat
from infinity.comm.process_group import group_given_by_caller
from infinity.config import InfinityConfig, load_config, no_effect_notices, resolve_auto, resolve_batch_sizes
from infinity.engine.grad_reduction import GradReducer, GradScaling
from infinity.engine.grad_replay import GradientReplay, recompute_gradients
from infinity.engine.host_memory import huge_pages_notice, keep_freed_blocks, return_freed_heap
from infinity.engine.inputs import move_inputs
from infinity.engine.memory_plan import (
    balance_step_timing,
    check_host_budget,
    grads_wait_in_host,
    home_bytes,
    plan_memory,
    spare_host_bytes,
)
from infinity.engine.param_groups import plan_groups
from infinity.engine.partition_sharing import PartitionSharing
from infinity.engine.readouts import EngineReadouts
from infinity.engine.save_dir_lock import release_save_dirs
from infinity.engine.setup import (
    apply_process_settings,
    check_model,
    compute_device,
    hidden_size,
    move_buffers,
    open_tiers,
    seed_everything,
)
from infinity.engine.sharding import shard_model
from infinity.engine.state_api import EngineStateIO
from infinity.estimator.machine import available_host_bytes
from infinity.optim.loss_scaler import LossScaler
from infinity.optim.lr_schedules import build_schedule
from infinity.optim.sharded_adam import ShardedAdam
from infinity.partition import plan_blocks
from infinity.partition.sharded_block import ShardedBlock
from infinity.profiler.null_writer import NullTraceWriter
from infinity.profiler.step_log import StepLog
from infinity.profiler.wall_clock import WallClock
from infinity.profiler.writer import open_trace_writer
from infinity.scheduler import BlockScheduler
from infinity.scheduler.unused_params import UnusedParameterCheck
from infinity.shards import MallocTuning, ShardStore, resolve_placement
from infinity.storage import MoveCounter, Tier


class InfinityEngine(EngineStateIO, EngineReadouts):
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
        check_model(model)
        cfg = load_config(config)
        device = compute_device()
        rank, world = init_distributed(device, cfg.zero_optimization.comm_timeout_s)
        group = dist.group.WORLD if world > 1 else None
        self.comm = CommGroup(rank, world, group, device=comm_device(device, group))
        # a stopped peer ends the run after heartbeat_timeout_s, not comm_timeout_s (unless the caller,
        # such as `infinity train`, watches the peers already)
        self._heartbeat = start_heartbeat(rank, world, cfg.zero_optimization.heartbeat_timeout_s, end_on_silence)
        self.config = cfg = resolve_auto(resolve_batch_sizes(cfg, world), hidden_size(model))
        if cfg.seed is not None:
            seed_everything(cfg.seed)  # before a meta model is materialized with its initializers
        if rank == 0:
            given = {"client_optimizer": optimizer is not None, "client_scheduler": lr_scheduler is not None}
            given["group_given"] = group_given_by_caller()
            for line in no_effect_notices(cfg, device.type == "cuda", world, **given):
                print(line, file=sys.stderr)
        z = cfg.zero_optimization
        self.placement = resolve_placement(cfg, device, world, client_optimizer=optimizer is not None)
        notice = huge_pages_notice() if self.placement.malloc is MallocTuning.RETURN_TO_OS else None
        if rank == 0 and notice is not None:  # every buffer a fresh mapping: see host_memory
            print(notice, file=sys.stderr)
        apply_process_settings(self.placement)
        self.module = model
        self.global_steps = 0
        self._step_applied = False  # the last optimizer step changed the weights (`was_step_applied`)
        self.micro_steps = 0
        self._backward_since_step = False  # engine.backward ran and engine.step has not yet counted it
        self.loss_scaler = LossScaler(cfg.fp16)
        move_buffers(model, device)

        groups = plan_groups(model, cfg.optimizer, model_parameters, optimizer)
        plan = plan_blocks(model, z.block_classes, z.block_size_elems, z.stage3_param_persistence_threshold)
        available = available_host_bytes()
        self.placement = balance_step_timing(
            cfg, self.placement, plan, groups.group_of, optimizer is not None, available
        )
        layout = (plan, groups.group_of, self.placement, cfg.gradient_accumulation_steps, z.sub_group_size)
        on_nvme, held = home_bytes(*layout), home_bytes(*layout, grads_in_host=True)
        waiting_grads = on_nvme[Tier.NVME] - held[Tier.NVME]
        self.grads_in_host = grads_wait_in_host(z, self.placement, waiting_grads, available)
        held_grads = waiting_grads if self.grads_in_host else 0
        spare = spare_host_bytes(z, self.placement, held_grads, available)
        recompute = recompute_gradients(cfg, self.placement, self.grads_in_host)
        memory = plan_memory(z, plan, self.placement, groups.group_of, spare, recompute)
        if z.host_budget_bytes is not None:  # host memory is the constraint: keep what its plan counts
            # the gather window, and the gradient flats in flight: those waiting for their step or their
            # NVMe write (half the optimizer's window), the one stepped and the one being filled
            self.comm.buffers.limit_lending(max(1, memory.optimizer_window // 2) + 2)
        homes = held if self.grads_in_host else on_nvme
        check_host_budget(z, homes)
        self.nvme_bytes_planned = homes[Tier.NVME]
        self.prof = open_trace_writer(cfg, rank, world) or NullTraceWriter()
        self.moves = MoveCounter(forward=self.prof)  # the bytes that moved between tiers, for bytes_moved
        self.tiers = open_tiers(cfg, memory, self.nvme_bytes_planned, rank, device, self.moves)
        self.shards = ShardStore(
            self.tiers,
            self.placement,
            self.comm,
            read_ahead_bytes=memory.param_read_ahead_bytes,
            grad_writes_in_flight=memory.optimizer_window // 2,  # as many as arrivals hold (memory_plan)
            grad_hold_bytes=held_grads,
            prof=self.prof,
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
        self.optimizer.engine_step = self.step  # the optimizer initialize returns steps as the engine does
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
        self.sharing = PartitionSharing(self.shards, z.allgather_bucket_size, self.prof)
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.wall_clock = WallClock(cfg.wall_clock_breakdown, cfg.steps_per_print, rank, sync)
        self.step_log = StepLog(cfg.steps_per_print, rank)
        self.last_grad_norm: float | None = None  # the global norm the last step took (clipping, fp16)
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
        self.grad_replay: GradientReplay | None = None
        if recompute:  # its hooks after the scheduler's: a block's call is captured once it is gathered
            parts = (self.blocks, self.persistent, self.scheduler, self.reducer, self.optimizer, self.shards)
            self.shards.grad_replay = self.grad_replay = GradientReplay(model, *parts, self.prof)
        self.moves.reset()  # bytes_moved counts training's moves, not the shards' first placement
        # freed buffers go back to the OS at once: keep one block's gradients' worth for reuse (host_memory);
        # last, so that an engine whose set-up fails holds nothing
        returns_to_os = self.placement.malloc is MallocTuning.RETURN_TO_OS
        self._give_up_freed_blocks = keep_freed_blocks(memory.freed_block_bytes if returns_to_os else 0)
        return_freed_heap()  # a model built in full left its unsharded weights in malloc's heap

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

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (scaled by 1/gradient_accumulation_steps and the fp16 loss scale)."""
        if self._backward_since_step:
            raise RuntimeError(
                "engine.backward() was called twice without engine.step() between: call engine.step() (or the "
                "optimizer's step()) after every backward; it counts the micro-batch and steps the weights only "
                f"every gradient_accumulation_steps (now {self.gradient_accumulation_steps}) micro-batches. To "
                "accumulate N micro-batches, set gradient_accumulation_steps to N"
            )
        scaled = loss * (self.loss_scaler.scale / self.gradient_accumulation_steps)
        self.shards.settle_all()  # a step still owed (a shard the forward did not gather) before new gradients
        self.scheduler.begin_backward()
        self.prof.set_phase("backward")
        self._record_live_bytes()
        with self.wall_clock.time("backward"):
            scaled.backward()
            self.scheduler.finish_backward()
            self.reducer.flush()
        self._backward_since_step = True

    def step(self) -> None:
        """At an accumulation boundary: clip, unscale, step the optimizer and the LR schedule."""
        self._refuse_autograd_backward()
        self._step_applied = False  # until an optimizer step changes the weights, as DeepSpeed says
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
            if self.step_log.due(self.global_steps):
                self.step_log.write(self.global_steps, self.skipped_steps, self.get_lr(), self.last_grad_norm)
        self.micro_steps += 1
        self._backward_since_step = False

    def _refuse_autograd_backward(self) -> None:
        """`loss.backward()` in place of `engine.backward(loss)` leaves the loss unscaled and the gradients outside
        blocks (root, persistent parameters) with no one to reduce and step them: refuse rather than drop them."""
        flats = [f for b in (self.root, self.persistent) for f in b.flats]
        outside = [s.fqn for f in flats for s, p in zip(f.slots, f.params, strict=True) if p.grad is not None]
        if outside or self.scheduler.phase.value == "backward":
            left = f"the gradient of '{outside[0]}' was" if outside else "gradients were"
            raise RuntimeError(
                f"{left} made by loss.backward(), which the engine does not see: call engine.backward(loss) instead "
                "(it scales the loss for gradient accumulation and fp16 and hands every gradient to the optimizer; "
                "after loss.backward() the parameters outside the blocks would never be stepped)"
            )

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
        in_order = self._forward_order()
        if self.grad_replay is not None:
            self.grad_replay.keep_persistent_weights()
        self.optimizer.step_shards(grad_scale=coef / scale, order=[f for flats in in_order for f in flats])
        self.optimizer.zero_grad()
        self.sharing.share(in_order)  # stages 1-2: arrives behind the next forward
        self.persistent.reshard()  # its gathered copy is stale: re-gathered at the next forward
        self.scheduler.reshard_all()  # as are blocks a forward left gathered for a backward that never ran
        if self.lr_scheduler is not None:
            with warnings.catch_warnings():  # torch counts the client optimizer's own steps, which the engine's replace
                warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before", UserWarning)
                self.lr_scheduler.step()
            self._sync_hyperparameters(into_client=not self._client_is_truth)
        self.global_steps += 1
        self._step_applied = True

    def _forward_order(self) -> list[list]:
        """The blocks' flats in the order the next forward reads them: persistent and root first, then the
        blocks as the last forward ran them (module order for those it did not run)."""
        seen = dict.fromkeys(self.scheduler.forward_trace.order)
        seen.update(dict.fromkeys(range(len(self.blocks))))
        return [self.persistent.flats, self.root.flats, *(self.blocks[i].flats for i in seen)]

    def wait_for_weights(self) -> None:
        """Return once the module holds the last step's weights everywhere: stages 1-2 share them in the
        background after `step()`, and a step deferred past the backward (the NVMe optimizer with clipping)
        runs as the next forward reaches each block; forward, state_dict() and the engine's methods wait by
        themselves."""
        self.sharing.wait_all()
        self.shards.settle_all()

    def close(self) -> None:
        """Release the engine's storage (the NVMe swap files are removed); call once training is done."""
        self.optimizer.stepper.drain(raise_errors=False)  # a failed write-behind: its swap file goes anyway
        try:
            self.sharing.wait_all()  # stages 1-2: the module holds the trained weights after close
        finally:
            self.scheduler.remove_hooks()
            if self.grad_replay is not None:
                self.grad_replay.remove_hooks()
            if self._unused_check is not None:
                self._unused_check.remove()
            self.shards.close()
            self.prof.close()
            self._give_up_freed_blocks()
            if self._heartbeat is not None:
                self._heartbeat.stop()
                self._heartbeat = None
            release_save_dirs(self.shards)  # another run may save into this engine's folders now

    destroy = close  # DeepSpeed's name

    def train(self, mode: bool = True) -> InfinityEngine:
        self.module.train(mode)
        return self

    def eval(self) -> InfinityEngine:
        return self.train(False)

    def zero_grad(self) -> None:
        """DeepSpeed's: drop the gradients accumulated so far (`step()` does it after each optimizer step)."""
        self.optimizer.zero_grad()
