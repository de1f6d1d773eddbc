"""DeepSpeed keys infinity accepts but that change nothing here, each with the reason: the one table of them.

A DeepSpeed config sets them for DeepSpeed's own machinery; infinity has no such machinery, or always does
what the key would ask for (`NO_EFFECT`). Other keys act only in some runs: with several ranks, with NVMe
offload, with fp16, without a client optimizer... (`_idle_here`). `no_effect_notices(cfg, ...)` gives one
line per such key set to a value other than its default; the engine prints them once at start (rank 0), so
a user never believes a key did something. So are the DeepSpeed-only keys a config asks something of
(`deepspeed_only.DEEPSPEED_ONLY`, kept in `cfg.deepspeed_only` by `load_config`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from infinity.config.deepspeed_only import DEEPSPEED_ONLY

# dotted key -> why it has no effect in infinity
NO_EFFECT: dict[str, str] = {
    "zero_allow_untested_optimizer": (
        "infinity steps its own Adam/AdamW over the shards; a client optimizer lends only its hyper-parameters, "
        "and any other optimizer type is refused, so no untested optimizer can run"
    ),
    "zero_optimization.contiguous_gradients": (
        "each block's gradients are always copied into one contiguous flat buffer before they are reduced"
    ),
    "zero_optimization.reduce_scatter": (
        "gradients are always reduce-scattered (stages 2-3) or all-reduced with this rank's slice kept (stage 1), "
        "as the stage decides"
    ),
    "zero_optimization.allgather_partitions": (
        "updated partitions always reach every rank by all-gather; there is no broadcast variant"
    ),
    "zero_optimization.round_robin_gradients": (
        "gradients are reduced block by block as each block's backward ends; there is no per-rank copy order to rotate"
    ),
    "zero_optimization.offload_optimizer.fast_init": (
        "optimizer state is written to its tier once per shard as the shard is created; there is no slower "
        "initialization to skip"
    ),
    "zero_optimization.offload_optimizer.ratio": (
        "DeepSpeed's partial offload (a fraction of the optimizer state stepped on the GPU) is not built: every "
        "shard's optimizer state lives on offload_optimizer.device and is stepped from there (by the native CPU "
        "Adam where that is host memory or NVMe)"
    ),
    "aio.use_gds": (
        "GPUDirect Storage is not used: swap I/O goes between NVMe and host memory (O_DIRECT), and host memory "
        "to the device by copies"
    ),
    "fp16.auto_cast": "infinity does not cast forward inputs; pass floating-point inputs in fp16 yourself",
    "checkpoint.load_universal": (
        "infinity's checkpoints load at any world size when zero_optimization.elastic_checkpoint is true; there is "
        "no separate universal format"
    ),
    "checkpoint.use_node_local_storage": (
        "every rank writes its own files into the one checkpoint folder rank 0 creates, so that folder must be "
        "shared by every node (a network file system); only the NVMe swap (nvme_path) is node-local"
    ),
}


def _lookup(cfg: Any, dotted: str) -> Any:
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


_FP16_DYNAMIC = ("initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis", "min_loss_scale")
_PARAM_READ_AHEAD = ("buffer_count", "buffer_size", "max_in_cpu")
_OPTIMIZER_STAGING = ("buffer_count", "pipeline_read", "pipeline_write")
_AIO = ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events")


def _idle_here(
    cfg: Any, world_size: int | None, group_given: bool, cuda: bool | None
) -> Iterator[tuple[tuple[str, ...], str]]:
    """(dotted keys, why) for the keys that act in some runs but not in this one (`world_size`, `cuda` None: not
    judged)."""
    z = cfg.zero_optimization
    if world_size == 1:
        reduction = ("zero_optimization.overlap_comm", "zero_optimization.reduce_bucket_size")
        reduction += ("communication_data_type", "prescale_gradients", "gradient_predivide_factor")
        yield reduction, "with one rank: its gradients are its shard, and nothing is reduced across ranks"
        yield ("zero_optimization.comm_timeout_s", "zero_optimization.heartbeat_timeout_s"), "with one rank"
        yield ("checkpoint.tag_validation",), "with one rank: there are no other ranks' tags to compare"
    elif world_size is not None and not z.overlap_comm:
        why = "with overlap_comm false: each block's reduction is waited for at once, so none are bucketed"
        yield ("zero_optimization.reduce_bucket_size",), why
    if group_given:
        why = "the process group was created before initialize, with its own timeout (init_process_group's timeout=)"
        yield ("zero_optimization.comm_timeout_s",), why
    if cfg.prescale_gradients:
        yield ("gradient_predivide_factor",), "with prescale_gradients true: all of the division comes before the sum"
    if z.stage < 3:
        keys = ("prefetch_bucket_size", "max_live_parameters", "max_reuse_distance")
        why = f"at stage {z.stage}: every rank holds every parameter whole, so none is gathered, prefetched or released"
        yield tuple(f"zero_optimization.stage3_{k}" for k in keys), why
    if z.block_classes:
        yield ("zero_optimization.block_size_elems",), "with block_classes set: those classes form the blocks"
    nvme = [section for section in ("offload_param", "offload_optimizer") if getattr(z, section).device == "nvme"]
    if not nvme:
        yield tuple(f"aio.{k}" for k in _AIO), "without NVMe offload: no swap file is read or written"
    if "offload_param" not in nvme:
        keys = ("nvme_path", *_PARAM_READ_AHEAD)
        yield tuple(f"zero_optimization.offload_param.{k}" for k in keys), "unless offload_param.device is nvme"
    elif z.host_budget_bytes is not None:
        why = "with host_budget_bytes set: the budget's plan sizes the parameters' read-ahead from NVMe"
        yield tuple(f"zero_optimization.offload_param.{k}" for k in _PARAM_READ_AHEAD), why
    if "offload_optimizer" not in nvme:
        keys = ("nvme_path", "recompute_gradients")
        yield tuple(f"zero_optimization.offload_optimizer.{k}" for k in keys), "unless offload_optimizer.device is nvme"
    staging = tuple(f"zero_optimization.offload_optimizer.{k}" for k in _OPTIMIZER_STAGING)
    if z.offload_optimizer.device == "none":
        yield staging, "with offload_optimizer.device 'none': torch's Adam steps the state where it lives"
    elif z.offload_optimizer.device == "cpu" and cuda is False:
        why = "with offload_optimizer.device 'cpu' on a CPU-only machine: the step works on the state in place"
        yield staging, why + ", with nothing to read ahead or copy back"
    if cfg.fp16.enabled is False:
        keys = ("loss_scale", *_FP16_DYNAMIC)
        yield tuple(f"fp16.{k}" for k in keys), "while fp16.enabled is false"
    elif cfg.fp16.enabled is True and cfg.fp16.loss_scale > 0:
        yield tuple(f"fp16.{k}" for k in _FP16_DYNAMIC), "with a static fp16.loss_scale: the scale never changes"
    if not cfg.profiler.enabled:
        yield ("profiler.path", "profiler.start_step", "profiler.end_step"), "while profiler.enabled is false"


def _optimizer_notices(cfg: Any, client_optimizer: bool, client_scheduler: bool) -> Iterator[str]:
    """The optimizer and scheduler sections: overridden by the client's objects, or keys their choice ignores."""
    prefix = "infinity: '{key}' is {value!r}: accepted, but it has no effect"
    if client_optimizer and cfg.optimizer is not None:
        yield prefix.format(key="optimizer", value=cfg.optimizer.type) + (
            ": the optimizer passed to initialize sets the algorithm and its hyper-parameters (as in DeepSpeed, it "
            "overrides the config's)"
        )
    if client_scheduler and cfg.scheduler is not None:
        yield prefix.format(key="scheduler", value=cfg.scheduler.type) + (
            ": the lr_scheduler passed to initialize sets the learning rate"
        )
    if client_optimizer or cfg.optimizer is None:
        return
    params = cfg.optimizer.params
    if params.get("torch_adam"):
        yield prefix.format(key="optimizer.params.torch_adam", value=True) + (
            ": infinity steps the shards with its own Adam (native CPU Adam for offloaded state, torch's ops on "
            "the device), whichever DeepSpeed implementation the key would pick"
        )
    if params.get("adam_w_mode") is False and cfg.optimizer.type.lower() == "adamw":
        yield prefix.format(key="optimizer.params.adam_w_mode", value=False) + (
            ": type AdamW always decays weights decoupled; for L2 regularization folded into the gradient use "
            'type "Adam" with adam_w_mode false'
        )
    schedule = cfg.scheduler
    if not client_scheduler and schedule is not None and schedule.type in ("WarmupLR", "WarmupDecayLR"):
        lr, peak = params.get("lr"), schedule.params.get("warmup_max_lr", 0.001)
        if lr is not None and lr != peak:
            yield prefix.format(key="optimizer.params.lr", value=lr) + (
                f": scheduler {schedule.type} sets every group's lr from warmup_min_lr up to warmup_max_lr ({peak})"
            )


def no_effect_notices(
    cfg: Any,
    cuda: bool | None = None,
    world_size: int | None = None,
    client_optimizer: bool = False,
    client_scheduler: bool = False,
    group_given: bool = False,
) -> list[str]:
    """One line per NO_EFFECT key whose value in `cfg` (an InfinityConfig) differs from its default, and per key
    set away from its default whose effect this run rules out: by the stage, the machine (`cuda`: whether the
    compute device is a GPU), the world size, the client's optimizer or lr scheduler given to initialize, a
    process group the caller created (`group_given`), or other keys. None: not judged."""
    from infinity.config.config import InfinityConfig

    default = InfinityConfig()
    lines = []
    for key, reason in NO_EFFECT.items():
        value = _lookup(cfg, key)
        if value != _lookup(default, key):
            lines.append(f"infinity: '{key}' is {value!r}: accepted, but it has no effect in infinity: {reason}")
    for key, value in cfg.deepspeed_only:
        why = DEEPSPEED_ONLY[key].why
        lines.append(f"infinity: '{key}' is {value!r}: accepted, but it has no effect in infinity: {why}")
    noticed = set(NO_EFFECT)
    for keys, why in _idle_here(cfg, world_size, group_given, cuda):
        for key in keys:
            value = _lookup(cfg, key)
            if key not in noticed and value != _lookup(default, key):
                noticed.add(key)
                lines.append(f"infinity: '{key}' is {value!r}: accepted, but it has no effect {why}")
    lines.extend(_optimizer_notices(cfg, client_optimizer, client_scheduler))
    z = cfg.zero_optimization
    if z.stage == 3 and z.allgather_bucket_size != default.zero_optimization.allgather_bucket_size:
        lines.append(
            f"infinity: 'zero_optimization.allgather_bucket_size' is {z.allgather_bucket_size!r}: accepted, but it "
            "has no effect at stage 3: each block is gathered by itself (stage3_prefetch_bucket_size sets how far "
            "ahead); at stages 1-2 it caps the all-gathers that share the updated partitions"
        )
    if cuda is False:
        for section in ("offload_param", "offload_optimizer"):
            if getattr(z, section).pin_memory:
                lines.append(
                    f"infinity: 'zero_optimization.{section}.pin_memory' is True: accepted, but it has no effect "
                    "on this machine: host memory is pinned only for copies to and from a GPU, and there is none"
                )
    return lines
