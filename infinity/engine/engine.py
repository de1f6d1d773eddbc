"""InfinityEngine: wires partition, placement, scheduler and optimizer into forward/backward/step."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from infinity.comm import CommGroup, init_distributed
from infinity.config import ConfigError, InfinityConfig, load_config, resolve_auto, resolve_batch_sizes
from infinity.engine.budgets import plan_budgets
from infinity.engine.grad_reduction import reduce_block_grads
from infinity.engine.host_memory import limit_freed_memory
from infinity.engine.param_groups import plan_groups
from infinity.engine.placement import ShardPlacement
from infinity.optim.loss_scaler import LossScaler
from infinity.optim.lr_schedules import build_schedule
from infinity.optim.sharded_adam import ShardedAdam
from infinity.optim.streamed_adam import StreamedAdam
from infinity.partition import FlatParam, plan_blocks
from infinity.partition.materialize import check_materializable, materialize_modules
from infinity.partition.sharded_block import ShardedBlock
from infinity.profiler.writer import open_trace_writer
from infinity.scheduler import BlockScheduler
from infinity.storage import TierStore

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TIERS = {"none": "device", "cpu": "host", "nvme": "nvme"}


def _hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _check_model(model: nn.Module) -> None:
    if getattr(model, "_infinity_engine", None) is not None:
        raise ValueError("this model is already wrapped by an infinity engine; pass the original model only once")
    for name, p in model.named_parameters():
        if getattr(p, "_infinity_flat", None) is not None:
            raise ValueError(f"parameter '{name}' is already sharded by another engine")
    if any(p.is_meta for p in model.parameters()):
        check_materializable(model)


class InfinityEngine:
    """A ZeRO-3 model: call it like the module, then `backward(loss)` and `step()`."""

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
        z = cfg.zero_optimization
        if z.stage != 3:
            raise ConfigError(
                f"'zero_optimization.stage' is {z.stage}; infinity implements ZeRO stage 3 only: set it to 3"
            )
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        rank, world = init_distributed(self.device, z.comm_timeout_s)
        self.comm = CommGroup(rank, world, dist.group.WORLD if world > 1 else None)
        cfg = resolve_auto(resolve_batch_sizes(cfg, world), _hidden_size(model))
        self.config = cfg
        self.compute_dtype = _DTYPES[cfg.compute_dtype_name]
        if self.device.type == "cpu":
            torch.set_flush_denormal(True)  # decaying weights in denormals slow CPU steps several-fold
        self.module = model
        self.global_steps = 0
        self.micro_steps = 0
        self.loss_scaler = LossScaler(cfg.fp16)

        param_tier = _TIERS[z.offload_param.device]
        optim_tier = _TIERS[z.offload_optimizer.device]
        if self.device.type == "cpu" and "nvme" in (param_tier, optim_tier):
            limit_freed_memory(return_to_os=z.host_budget_bytes is not None)  # see host_memory
        for buf_module in model.modules():
            for key, buf in buf_module._buffers.items():
                if buf is not None:
                    buf_module._buffers[key] = buf.to(self.device)
        groups = plan_groups(model, cfg.optimizer, model_parameters, optimizer)

        plan = plan_blocks(model, z.block_classes, z.block_size_elems, z.stage3_param_persistence_threshold)
        # A CPU-only machine computes from host memory; given its own `device_budget_bytes`, the device
        # tier stands apart from the host (as on a GPU) and gathers copy shards into it.
        compute_reads_host = self.device.type == "cpu" and z.device_budget_bytes is None
        budget_plan = plan_budgets(
            z, plan, world, self.compute_dtype.itemsize, param_tier, optim_tier, compute_reads_host
        )
        self.prof = open_trace_writer(cfg, rank, world)  # None unless the config's profiler is enabled
        self.store = TierStore.from_config(
            z.offload_param,
            z.offload_optimizer,
            cfg.aio,
            budget_plan.budgets,
            rank=rank,
            device=self.device,
            recorder=self.prof,
        )
        self.placement = ShardPlacement(
            self.store, param_tier, compute_reads_host, read_ahead_bytes=budget_plan.param_read_ahead_bytes
        )
        if optim_tier == "nvme":
            self.optimizer: ShardedAdam = StreamedAdam(
                groups.groups, groups.adamw_mode, self.placement, self.store, budget_plan.optimizer_window
            )
            # Nothing global to wait for (a clipping norm, an fp16 overflow check, a client optimizer's
            # hyper-parameters set at step time): step each shard while backward goes on.
            self.optimizer.step_as_grads_arrive = (
                cfg.gradient_clipping <= 0 and not self.loss_scaler.enabled and optimizer is None
            )
        else:
            self.optimizer = ShardedAdam(groups.groups, groups.adamw_mode, optim_tier != "device", self.placement)
        self._optim_device = self.device if optim_tier == "device" else torch.device("cpu")

        # Block by block: materialize (if built on meta), flatten, shard, store; never the whole model at once.
        self.blocks = []
        for i, (name, module, uses) in enumerate(plan.blocks):
            materialize_modules(module.modules(), model, torch.device("cpu"))
            self.blocks.append(ShardedBlock(i, name, module, self._shard(name, uses, groups.group_of, False)))
        materialize_modules(model.modules(), model, torch.device("cpu"))
        self.root = ShardedBlock(-1, "<root>", model, self._shard("<root>", plan.root, groups.group_of, False))
        self.persistent = ShardedBlock(
            -2, "<persistent>", None, self._shard("<persistent>", plan.persistent, groups.group_of, True)
        )
        self.flats = [f for b in (*self.blocks, self.root, self.persistent) for f in b.flats]
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
            self.placement,
            self._reduce_block_grads,
            prefetch_bucket_elems=z.stage3_prefetch_bucket_size,
            max_live_elems=z.stage3_max_live_parameters,
            max_reuse_distance_elems=z.stage3_max_reuse_distance,
        )
        self.scheduler.prof = self.prof
        self.scheduler.gather_waits_on = {"device": "all-gather", "host": "host->device", "nvme": "nvme->host"}[
            param_tier
        ]
        model._infinity_engine = self

    # -- construction helpers ------------------------------------------------------------------

    def _shard(self, name: str, uses, group_of: dict[int, int], persistent: bool) -> list[FlatParam]:
        """One FlatParam per param group (frozen ones apart), each sharded into the store at once."""
        by_group: dict[int | None, list] = {}
        for fqn, old_param, param_uses in uses:
            module, attr = param_uses[0]
            current = module._parameters[attr]  # materialization may have replaced a meta parameter
            by_group.setdefault(group_of.get(id(old_param)), []).append((fqn, current, param_uses))
        flats = []
        for group_index, members in sorted(by_group.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            tag = "frozen" if group_index is None else group_index
            flat = FlatParam(
                f"{name}#{tag}", members, self.compute_dtype, self.device, self.comm, group_index, persistent
            )
            for p in flat.params:
                p._infinity_flat = flat
                p._infinity_owner = self
            self._place(flat)
            flats.append(flat)
        return flats

    def _place(self, flat: FlatParam) -> None:
        """Put the flat's shard in the store and its master in the optimizer; free the full values."""
        full32 = flat.initial_full_fp32()
        flat.install_views()  # from here on the parameters are views into the flat buffer
        start, end = flat.shard_range
        self.placement.put(flat, full32[start:end].to(self.compute_dtype))
        home = self.placement.home(flat)
        if flat.requires_grad:
            if home is not None and home.dtype == torch.float32 and home.device == self._optim_device:
                master = home  # fp32 with weights and optimizer on one tier: one copy serves both
            else:
                master = full32[start:end].to(self._optim_device, copy=True)
            self.optimizer.add_shard(flat, master, home)
        if not self.comm.distributed and home is not None and home.device == self.device:
            flat.bind_resident(home)  # one rank, shard already where compute runs: nothing to gather
        elif flat.persistent:
            with torch.no_grad():
                flat.full.copy_(full32)
        else:
            flat.release()

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
        reduce_block_grads(block, self.comm, self.optimizer, self.is_gradient_accumulation_boundary(), self.prof)

    # -- the training API ----------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        if self.prof is not None:
            if self.micro_steps % self.gradient_accumulation_steps == 0 and self.scheduler.phase.value == "idle":
                self.prof.begin_step(self.global_steps)
            self.prof.set_phase("forward")
        return self.module(*args, **kwargs)

    def _record_live_bytes(self) -> None:
        for tier in ("device", "host", "nvme"):
            self.prof.live(tier, self.store.live_bytes(tier))

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (scaled by 1/gradient_accumulation_steps and the fp16 loss scale)."""
        scaled = loss * (self.loss_scaler.scale / self.gradient_accumulation_steps)
        self.scheduler.begin_backward()
        if self.prof is not None:
            self.prof.set_phase("backward")
            self._record_live_bytes()
        scaled.backward()
        self.scheduler.finish_backward()

    def step(self) -> None:
        """At an accumulation boundary: clip, unscale, step the optimizer and the LR schedule."""
        if self.is_gradient_accumulation_boundary():
            if self.prof is not None:
                self.prof.set_phase("optimizer")
                self._record_live_bytes()
            self._optimizer_step()
            if self.prof is not None:
                self._record_live_bytes()
                self.prof.end_step(self.global_steps - 1)
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
        if self._client_is_truth:
            self._sync_hyperparameters(into_client=False)
        clip = self.config.gradient_clipping
        scale = self.loss_scaler.scale
        coef = 1.0
        if clip > 0 or self.loss_scaler.enabled:
            norm_sq = self.optimizer.local_grad_norm_sq().to(self.device)
            self.comm.all_reduce(norm_sq, "gradient norm")
            norm = math.sqrt(norm_sq.item()) / scale if math.isfinite(norm_sq.item()) else math.inf
            self.last_grad_norm = norm
            if self.loss_scaler.update(overflow=not math.isfinite(norm)):
                self.optimizer.zero_grad()
                self.global_steps += 1
                return
            coef = ShardedAdam.clip_coefficient(norm, clip)
        self.optimizer.step(grad_scale=coef / scale)
        self.optimizer.zero_grad()
        self.persistent.release()  # its gathered copy is stale: re-gathered at the next forward
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
            self._sync_hyperparameters(into_client=not self._client_is_truth)
        self.global_steps += 1

    @property
    def bytes_moved(self) -> dict[str, int]:
        """Bytes moved between tiers so far, per "from->to" pair (parameters, gradients, optimizer state)."""
        moved = dict(self.placement.bytes_moved)
        if self.optimizer.grad_bytes_to_host:
            moved["device->host"] = self.optimizer.grad_bytes_to_host
        for pair, nbytes in getattr(self.optimizer, "nvme_bytes", {}).items():
            moved[pair] = moved.get(pair, 0) + nbytes
        return moved

    @property
    def stall_s(self) -> float:
        """Seconds compute waited for a block's weights to arrive."""
        return self.scheduler.stall_s

    def close(self) -> None:
        """Release the engine's storage (the NVMe swap files are removed); call once training is done."""
        self.optimizer.finish_param_writes()
        self.scheduler.remove_hooks()
        self.store.close()
        if self.prof is not None:
            self.prof.close()

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

    def save_checkpoint(
        self, save_dir: str, tag: str | None = None, client_state: dict | None = None, save_latest: bool = True
    ) -> str:
        """Write a sharded checkpoint (every rank calls this); returns its folder."""
        from infinity.engine.checkpoint import save_checkpoint

        self.optimizer.refuse_mid_step("save_checkpoint")

        return str(save_checkpoint(self, save_dir, tag, client_state or {}, save_latest))

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

        folder, client_state = load_checkpoint(
            self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only
        )
        return str(folder), client_state

    def iter_full_state(self):
        """Yield (name, full fp32 CPU tensor) block by block; every rank must iterate it to the end."""
        from infinity.engine.state_io import iter_full_state

        return iter_full_state(self)

    def load_full_state(self, source, strict: bool = True) -> list[str]:
        """Load pretrained weights (a state dict, a torch file or a folder of safetensors), block by block."""
        from infinity.engine.state_io import load_full_state

        self.optimizer.refuse_mid_step("load_full_state")

        return load_full_state(self, source, strict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from infinity.engine.gathered import full_state_dict

        return full_state_dict(self)
