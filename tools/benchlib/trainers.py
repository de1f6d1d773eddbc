"""One training step of the same model under each framework the benchmarks compare.

A configuration names a framework and where it keeps parameters and optimizer state:

    plain                 torch.optim.AdamW(fused=True) in one process, no sharding
    ddp                   DistributedDataParallel (defaults) + fused AdamW: the unsharded floor
    fsdp2_none            FSDP2 fully_shard per Block and the root, fused AdamW
    fsdp2_cpu             the same with CPUOffloadPolicy (parameters, gradients and Adam on the host)
    deepspeed_z3_<o>      DeepSpeed ZeRO-3 with offload <o> (below), DeepSpeed's own (CPU) Adam
    deepspeed_z2_<o>      DeepSpeed ZeRO-2, offload_optimizer <o> (none, cpu)
    infinity_z3_<o>       infinity ZeRO-3 with offload <o>
    infinity_z2_<o>       infinity with zero_optimization.stage 2, offload_optimizer <o> (none, cpu, nvme)

Offload <o>: none, cpu (offload_param cpu + offload_optimizer cpu), nvme (both nvme), nvme_param
(parameters nvme, optimizer cpu); at stage 2 only the optimizer is offloaded.
bf16: infinity and DeepSpeed `bf16.enabled`; FSDP2 MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32); plain and DDP torch.autocast("cpu", bf16) over fp32 weights. Clipping: the
frameworks' `gradient_clipping`, torch.nn.utils.clip_grad_norm_ for plain, DDP and FSDP2.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

HYPER = {"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}

# offload suffix -> (offload_param.device, offload_optimizer.device)
OFFLOADS = {"none": ("none", "none"), "cpu": ("cpu", "cpu"), "nvme": ("nvme", "nvme"), "nvme_param": ("nvme", "cpu")}


@dataclass(frozen=True)
class TrainConfig:
    """One benchmarked configuration: a framework, its ZeRO stage and where its state lives."""

    name: str
    framework: str  # plain | ddp | fsdp2 | deepspeed | infinity
    stage: int | None  # ZeRO stage; FSDP2 counts as 3; None for plain and DDP
    offload_param: str  # none | cpu | nvme
    offload_optimizer: str

    @property
    def distributed(self) -> bool:
        """Runs as --nproc ranks (plain is always one process)."""
        return self.framework != "plain"

    @property
    def peer_key(self) -> tuple[int | None, str, str]:
        """Configurations with the same key keep the same state sharded on the same tiers."""
        return self.stage, self.offload_param, self.offload_optimizer


def _configs() -> dict[str, TrainConfig]:
    out = [TrainConfig("plain", "plain", None, "none", "none"), TrainConfig("ddp", "ddp", None, "none", "none")]
    out += [TrainConfig(f"fsdp2_{o}", "fsdp2", 3, o, o) for o in ("none", "cpu")]
    for framework in ("deepspeed", "infinity"):
        out += [TrainConfig(f"{framework}_z3_{o}", framework, 3, *OFFLOADS[o]) for o in OFFLOADS]
        stage2 = ("none", "cpu") if framework == "deepspeed" else ("none", "cpu", "nvme")  # DeepSpeed: no nvme at 2
        out += [TrainConfig(f"{framework}_z2_{o}", framework, 2, "none", o) for o in stage2]
    return {c.name: c for c in out}


CONFIGS = _configs()
# names used before stages were part of the name
ALIASES = {f"{fw}_{o}": f"{fw}_z3_{o}" for fw in ("infinity", "deepspeed") for o in OFFLOADS}


def resolve_names(names: list[str]) -> list[str]:
    """Canonical names for `names` (aliases resolved); ValueError naming the unknown ones."""
    out = [ALIASES.get(n, n) for n in names]
    unknown = [n for n, c in zip(names, out, strict=True) if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; choose from {','.join(CONFIGS)}")
    return out


@dataclass(frozen=True)
class StepOptions:
    """What every framework's step is built from, per rank."""

    micro_batch: int
    dtype: str  # fp32 | bf16
    clip: float  # 0: off
    nvme_path: str  # this configuration's own folder
    threads: int
    engine_timers: bool = False
    profile_dir: str | None = None  # infinity: record swap traces there (the profiler)
    profile_from_step: int = 0  # the first step they cover


PhaseFn = Callable[[torch.Tensor, torch.Tensor], dict[str, float]]


def timed_phases(forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None],
                 step: Callable[[], None]) -> dict[str, float]:  # fmt: skip
    """forward -> backward -> step, each timed by the wall clock; {"loss", "forward_s", "backward_s", "optimizer_s"}."""
    t0 = time.perf_counter()
    loss = forward()
    t1 = time.perf_counter()
    backward(loss)
    t2 = time.perf_counter()
    step()
    t3 = time.perf_counter()
    return {"loss": loss.item(), "forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2}


class Trainer:
    """`step(x, y)` -> loss and phase times; `counters()` -> cumulative counters (infinity); `close()`."""

    def __init__(self, step: PhaseFn, counters: Callable[[], dict[str, Any]] | None = None,
                 close: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.step = step
        self.counters = counters or dict
        self.close = close or (lambda: None)


def _torch_trainer(model: torch.nn.Module, opts: StepOptions, autocast: bool) -> Trainer:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, **HYPER, fused=True)
    cast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else nullcontext

    def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with cast():
            return model(x, y)[1]

    def optimizer_step() -> None:
        if opts.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, opts.clip)
        opt.step()

    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        opt.zero_grad(set_to_none=True)
        return timed_phases(lambda: forward(x, y), lambda loss: loss.backward(), optimizer_step)

    return Trainer(step)


def _plain(model: torch.nn.Module, cfg: TrainConfig, opts: StepOptions) -> Trainer:
    return _torch_trainer(model, opts, autocast=opts.dtype == "bf16")


def _ddp(model: torch.nn.Module, cfg: TrainConfig, opts: StepOptions) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel

    return _torch_trainer(DistributedDataParallel(model), opts, autocast=opts.dtype == "bf16")


def _fsdp2(model: torch.nn.Module, cfg: TrainConfig, opts: StepOptions) -> Trainer:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = {
        "mesh": mesh,
        "mp_policy": mixed if opts.dtype == "bf16" else MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy(pin_memory=False) if cfg.offload_param == "cpu" else OffloadPolicy(),
    }
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return _torch_trainer(model, opts, autocast=False)


def _ds_config(cfg: TrainConfig, opts: StepOptions, framework: str) -> dict[str, Any]:
    """The DeepSpeed-style JSON both DeepSpeed and infinity take for `cfg`."""
    zero: dict[str, Any] = {
        "stage": cfg.stage,
        "offload_optimizer": {"device": cfg.offload_optimizer, "nvme_path": opts.nvme_path},
    }
    if cfg.stage == 3:
        zero["offload_param"] = {"device": cfg.offload_param, "nvme_path": opts.nvme_path}
    if framework == "infinity":
        zero["block_classes"] = ["Block"]
    config = {
        "train_micro_batch_size_per_gpu": opts.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": opts.clip,
        "steps_per_print": 1_000_000,  # no progress log in the timed steps, either framework's
        "optimizer": {"type": "AdamW", "params": {**HYPER, "betas": list(HYPER["betas"])}},
        "bf16": {"enabled": opts.dtype == "bf16"},
        "zero_optimization": zero,
    }
    if framework == "infinity" and opts.profile_dir is not None:
        config["profiler"] = {"enabled": True, "path": opts.profile_dir, "start_step": opts.profile_from_step}
    if framework == "deepspeed":
        config.update(
            fp16={"enabled": False},
            aio={"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1},
        )
    return config


def _deepspeed(model: torch.nn.Module, cfg: TrainConfig, opts: StepOptions) -> Trainer:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    config = _ds_config(cfg, opts, "deepspeed")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch.set_num_threads(opts.threads)  # its CPU accelerator may have changed it

    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        return timed_phases(lambda: engine(x, y)[1], engine.backward, engine.step)

    return Trainer(step, close=getattr(engine, "destroy", None))


def _infinity(model: torch.nn.Module, cfg: TrainConfig, opts: StepOptions) -> Trainer:
    import infinity

    engine, _, _, _ = infinity.initialize(model=model, config=_ds_config(cfg, opts, "infinity"))
    timer = instrument_engine_internals(engine) if opts.engine_timers else None

    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        out = timed_phases(lambda: engine(x, y)[1], engine.backward, engine.step)
        if timer is not None:
            out.update(timer.take())
        return out

    def counters() -> dict[str, Any]:  # the engine's public counters, cumulative
        out = {"bytes_moved": dict(engine.bytes_moved), "stall_s": engine.stall_s,
               "kept_buffer_bytes": engine.kept_buffer_bytes}  # fmt: skip
        if timer is not None and timer.missing:
            out["engine_timers_missing"] = timer.missing
        return out

    return Trainer(step, counters, engine.close)


_MODULES = {"plain": "torch.optim", "ddp": "torch.nn.parallel", "fsdp2": "torch.distributed.fsdp",
            "deepspeed": "deepspeed", "infinity": "infinity"}  # fmt: skip


def import_framework(cfg: TrainConfig) -> None:
    """Import `cfg`'s framework now, so that memory measured before the model is built includes its code."""
    importlib.import_module(_MODULES[cfg.framework])


BUILDERS = {"plain": _plain, "ddp": _ddp, "fsdp2": _fsdp2, "deepspeed": _deepspeed, "infinity": _infinity}


def build_trainer(model: torch.nn.Module, cfg: TrainConfig, opts: StepOptions) -> Trainer:
    """Wrap `model` (built on the CPU, same seed on every rank) for `cfg`; the process group is up if needed."""
    return BUILDERS[cfg.framework](model, cfg, opts)


# -- ENGINE INTERNALS ---------------------------------------------------------------------------------
# The only place a benchmark reaches inside infinity's engine; opt-in (--engine-timers) because the
# engine's core is being redesigned and these objects may change or go. Missing ones are skipped and
# named. Everything else measures from outside: engine.bytes_moved, engine.stall_s and the wall
# clock around engine(x, y), engine.backward and engine.step.


class _SecondsByName:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.missing: list[str] = []

    def wrap(self, obj: object, attr: str, name: str) -> None:
        inner = getattr(obj, attr, None)
        if inner is None:
            self.missing.append(f"{type(obj).__name__}.{attr}")
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        setattr(obj, attr, timed)

    def take(self) -> dict[str, float]:
        seconds, self.seconds = self.seconds, {}
        return {f"engine:{k}": v for k, v in seconds.items()}


def instrument_engine_internals(engine: Any) -> _SecondsByName:
    """Time (per step, summed) gathers, reshards, shard fetches, gradient reductions and the Adam step."""
    timer = _SecondsByName()
    for block in (*getattr(engine, "blocks", ()), getattr(engine, "root", None), getattr(engine, "persistent", None)):
        if block is not None:
            timer.wrap(block, "start_unshard", "fetch_issue_s")  # ask the store for the block's shards
            timer.wrap(block, "wait_unshard", "gather_wait_s")  # wait for them, all-gather (a copy at world 1)
            timer.wrap(block, "reshard", "reshard_s")
    for owner, attr, name in (
        ("shards", "fetch_param", "fetch_param_s"),  # a shard's move from its home tier toward the compute
        ("reducer", "reduce_block", "reduce_grads_s"),  # flat grad, reduce-scatter, accumulate
        ("optimizer", "step_shards", "adam_s"),
    ):
        obj = getattr(engine, owner, None)
        if obj is None:
            timer.missing.append(f"engine.{owner}")
        else:
            timer.wrap(obj, attr, name)
    return timer
