"""DeepSpeed keys infinity accepts but that change nothing here, each with the reason: the one table of them.

A DeepSpeed config sets them for DeepSpeed's own machinery; infinity has no such machinery, or always does
what the key would ask for. `no_effect_notices(cfg)` gives one line per such key set to a value other than
its default; the engine prints them once at start (rank 0), so a user never believes a key did something.
"""

from __future__ import annotations

from typing import Any

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
        "shard's optimizer state lives on offload_optimizer.device and is stepped there by the native CPU Adam"
    ),
    "fp16.auto_cast": "infinity does not cast forward inputs; pass floating-point inputs in fp16 yourself",
    "checkpoint.tag_validation": (
        "every rank's checkpoint files carry a manifest with sizes and SHA-256, checked at load, and the tag is "
        "derived from the global step all ranks share"
    ),
    "checkpoint.load_universal": (
        "infinity's checkpoints load at any world size when zero_optimization.elastic_checkpoint is true; there is "
        "no separate universal format"
    ),
    "checkpoint.use_node_local_storage": (
        "every rank writes its own files into the checkpoint folder it is given; use a node-local folder as "
        "--save-dir to keep them on the node"
    ),
}


def _lookup(cfg: Any, dotted: str) -> Any:
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def no_effect_notices(cfg: Any, cuda: bool | None = None) -> list[str]:
    """One line per NO_EFFECT key whose value in `cfg` (an InfinityConfig) differs from its default, and per key
    whose effect the stage, or the machine (`cuda`: whether the compute device is a GPU; None: not judged),
    rules out."""
    from infinity.config.config import InfinityConfig

    default = InfinityConfig()
    lines = []
    for key, reason in NO_EFFECT.items():
        value = _lookup(cfg, key)
        if value != _lookup(default, key):
            lines.append(f"infinity: '{key}' is {value!r}: accepted, but it has no effect in infinity: {reason}")
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
