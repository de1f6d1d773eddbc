"""DeepSpeed keys for machinery infinity does not have, each judged by its value: the one table of them.

A DeepSpeed config carries sections infinity has no use for (monitors, profilers, Apex AMP, ZeRO++...), often
switched off. Each key of `DEEPSPEED_ONLY` is accepted with any value DeepSpeed writes; only whether that value
asks for something is judged (`DeepSpeedKey.asks`), and the rest of its section is not read. A value that asks
for nothing (the section disabled, DeepSpeed's default, or what infinity always does) is silent. One that asks
for something is either without effect on infinity's training (`refused` False: accepted, and named once at
start with `why` by `notices.no_effect_notices`) or would change the math, memory or parallelism in a way
infinity does not implement (`refused` True: a ConfigError naming the key, with `why` saying what to do).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from infinity.config.schema import ConfigError, json_fields, unknown_key_error


@dataclass(frozen=True)
class DeepSpeedKey:
    """What infinity makes of one DeepSpeed-only key whose value `asks` for something."""

    asks: Callable[[Any], bool]
    why: str  # accepted: why it has no effect (and what infinity offers); refused: what to do instead
    refused: bool = False


def _unless(*off: Any) -> Callable[[Any], bool]:
    """Asks for something unless the value is one of `off`."""
    return lambda value: value not in off


def _above(limit: int) -> Callable[[Any], bool]:
    """Asks for something unless the value is a number of at most `limit`."""
    return lambda value: isinstance(value, bool) or not isinstance(value, int | float) or value > limit


def _noticed(asks: Callable[[Any], bool], why: str) -> DeepSpeedKey:
    return DeepSpeedKey(asks, why)


def _refused(asks: Callable[[Any], bool], feature: str, instead: str) -> DeepSpeedKey:
    return DeepSpeedKey(asks, f"infinity does not implement {feature}; {instead}", refused=True)


_MONITOR = (
    "infinity writes to no monitor: rank 0 prints the step, its learning rates and gradient norm every "
    "steps_per_print steps (`infinity train` prints its progress line), and the profiler section records each "
    "step's time (`infinity profile`); log the losses your loop sees yourself"
)
_SWITCHED_OFF = "set it false or remove it"
_ACTIVATIONS = "DeepSpeed's activation checkpointing API (deepspeed.checkpointing), which infinity does not provide"

DEEPSPEED_ONLY: dict[str, DeepSpeedKey] = {
    # monitoring and logging: nothing in the training changes
    "tensorboard.enabled": _noticed(_unless(False), _MONITOR),
    "wandb.enabled": _noticed(_unless(False), _MONITOR),
    "csv_monitor.enabled": _noticed(_unless(False), _MONITOR),
    "comet.enabled": _noticed(_unless(False), _MONITOR),
    "flops_profiler.enabled": _noticed(
        _unless(False),
        "infinity counts no FLOPs; the profiler section times each step's compute, swap traffic and stalls "
        "(`infinity profile`)",
    ),
    "comms_logger.enabled": _noticed(
        _unless(False), "the profiler section records every collective with its bytes and duration"
    ),
    "memory_breakdown": _noticed(
        _unless(False),
        "infinity prints no memory use per step; `infinity estimate` gives device, host and NVMe memory per "
        "stage and offload, and `infinity profile` plots the bytes live during a step",
    ),
    "dump_state": _noticed(
        _unless(False), "`infinity config FILE` prints the resolved config, every default filled in"
    ),
    "activation_checkpointing.synchronize_checkpoint_boundary": _noticed(
        _unless(False), f"it configures {_ACTIVATIONS}"
    ),
    "activation_checkpointing.profile": _noticed(_unless(False), f"it configures {_ACTIVATIONS}"),
    "activation_checkpointing.number_checkpoints": _noticed(_unless(None), f"it configures {_ACTIVATIONS}"),
    # settings infinity always satisfies, or whose only effect is inside DeepSpeed's own implementation
    "zero_force_ds_cpu_optimizer": _noticed(
        _unless(True),
        "offloaded optimizer state is always stepped by infinity's native CPU Adam; a client optimizer lends only "
        "its hyper-parameters",
    ),
    "zero_optimization.load_from_fp32_weights": _noticed(
        _unless(True), "load_checkpoint always restores the fp32 master weights from the checkpoint's fp32 copy"
    ),
    "zero_optimization.stage3_model_persistence_threshold": _noticed(
        _unless(sys.maxsize),
        "every parameter below stage3_param_persistence_threshold stays whole on each rank, with no cap on their total",
    ),
    "zero_optimization.use_multi_rank_bucket_allreduce": _noticed(
        _unless(True),
        "gradients are reduce-scattered (stages 2-3) or all-reduced (stage 1) block by block; there are no "
        "per-rank reduces to combine",
    ),
    "zero_optimization.mics_hierarchical_params_gather": _noticed(
        _unless(False), "it shapes the gathers of MiCS sharding (mics_shard_size), which infinity does not implement"
    ),
    "zero_optimization.legacy_stage1": _noticed(
        _unless(False), "infinity has one stage 1: an all-reduce of each block's gradients that keeps this rank's slice"
    ),
    "zero_optimization.memory_efficient_linear": _noticed(
        _unless(True), "infinity never replaces torch's linear layers, whatever this key says"
    ),
    "zero_optimization.cpu_offload_use_pin_memory": _noticed(
        _unless(None, False),
        "DeepSpeed's deprecated name, without effect there too; pinning is set by offload_param.pin_memory and "
        "offload_optimizer.pin_memory",
    ),
    "bf16.immediate_grad_update": _noticed(
        _unless(False),
        "each block's gradients reach their fp32 accumulator as that block's backward ends, whatever this key "
        "says; the sum is the same",
    ),
    # would change the math, memory or parallelism: refused when on
    "data_types.grad_accum_dtype": _refused(
        _unless(None, "fp32"),
        "summing gradients over micro-batches in a 16-bit dtype (infinity always sums them in fp32)",
        'set it "fp32" or remove it',
    ),
    "amp.enabled": _refused(
        _unless(False, "auto"),  # "auto": Hugging Face's Trainer turns it on only for its Apex backend
        "NVIDIA Apex AMP",
        f'{_SWITCHED_OFF}; mixed precision is "bf16": {{"enabled": true}} or "fp16": {{"enabled": true}}',
    ),
    "torch_autocast.enabled": _refused(
        _unless(False),
        "torch.autocast around forward",
        f'{_SWITCHED_OFF}; mixed precision is "bf16": {{"enabled": true}} or "fp16": {{"enabled": true}}',
    ),
    "bf16.check_grad_overflow": _refused(
        _unless(False),
        "skipping bf16 steps whose gradients are not finite (fp16's loss scaler skips overflowing steps)",
        _SWITCHED_OFF,
    ),
    "bf16.bf16_master_weights_and_grads": _refused(
        _unless(False), "bf16 master weights and gradients (they are always fp32)", _SWITCHED_OFF
    ),
    "bf16.bf16_optimizer_states": _refused(
        _unless(False),
        "DeepSpeed's bf16 optimizer states",
        f'{_SWITCHED_OFF}; Adam\'s moments in bf16 are zero_optimization.offload_optimizer.moments "bf16"',
    ),
    "zero_optimization.zero_quantized_weights": _refused(_unless(False), "ZeRO++ quantized weights", _SWITCHED_OFF),
    "zero_optimization.zero_quantized_nontrainable_weights": _refused(
        _unless(False), "ZeRO++ quantized frozen weights", _SWITCHED_OFF
    ),
    "zero_optimization.zero_quantized_gradients": _refused(
        _unless(False),
        "ZeRO++ quantized gradients",
        f"{_SWITCHED_OFF}; communication_data_type sets the dtype gradients cross ranks in",
    ),
    "zero_optimization.zero_hpz_partition_size": _refused(
        _above(1),
        "ZeRO++ hierarchical partitioning (a secondary copy of the weights per node)",
        "set it 1 or remove it",
    ),
    "zero_optimization.mics_shard_size": _refused(
        _above(0), "MiCS sharding over groups of ranks (every rank holds 1/world size)", "set it -1 or remove it"
    ),
    "zero_optimization.cpu_offload": _refused(
        _unless(None, False),
        "this deprecated DeepSpeed name",
        'write "offload_optimizer": {"device": "cpu"} in zero_optimization instead',
    ),
    "zero_optimization.cpu_offload_param": _refused(
        _unless(None, False),
        "this deprecated DeepSpeed name",
        'write "offload_param": {"device": "cpu"} in zero_optimization instead',
    ),
    "sparse_gradients": _refused(_unless(False), "sparse gradient reduction (every gradient is dense)", _SWITCHED_OFF),
    "fp32_allreduce": _refused(
        _unless(False), "this DeepSpeed name", 'write "communication_data_type": "fp32" instead to reduce in fp32'
    ),
    "activation_checkpointing.partition_activations": _refused(
        _unless(False), f"activation partitioning: it is part of {_ACTIVATIONS}", _SWITCHED_OFF
    ),
    "activation_checkpointing.cpu_checkpointing": _refused(
        _unless(False), f"activation offload to the CPU: it is part of {_ACTIVATIONS}", _SWITCHED_OFF
    ),
    "activation_checkpointing.contiguous_memory_optimization": _refused(
        _unless(False), f"contiguous activation buffers: they are part of {_ACTIVATIONS}", _SWITCHED_OFF
    ),
    "compile.enabled": _refused(_unless(False), "DeepSpeed's compiled engine", _SWITCHED_OFF),
    "compile.deepcompile": _refused(_unless(False), "DeepSpeed's DeepCompile", _SWITCHED_OFF),
    "elasticity.enabled": _refused(
        _unless(False),
        "elastic batch sizes chosen from the GPU count",
        f"{_SWITCHED_OFF}, and give the batch sizes; zero_optimization.elastic_checkpoint resumes at another world "
        "size",
    ),
    "autotuning.enabled": _refused(
        _unless(False),
        "DeepSpeed's autotuner (which ends the run after its profiled steps)",
        f"{_SWITCHED_OFF}; `infinity tune --config FILE` tries infinity's own settings",
    ),
    "data_efficiency.enabled": _refused(
        _unless(False),
        "DeepSpeed's data sampling and routing (they change the batches)",
        f"{_SWITCHED_OFF}; infinity trains on the batches you pass",
    ),
    "curriculum_learning.enabled": _refused(
        _unless(False),
        "curriculum learning (it changes the batches' sequence lengths)",
        f"{_SWITCHED_OFF}; infinity trains on the batches you pass",
    ),
    "progressive_layer_drop.enabled": _refused(_unless(False), "progressive layer dropping", _SWITCHED_OFF),
}

_ABSENT = object()


def _is_root(dotted: str) -> bool:
    return any(key == dotted or key.startswith(dotted + ".") for key in DEEPSPEED_ONLY)


def _names_under(path: str) -> tuple[str, ...]:
    """The DeepSpeed-only keys directly in typed section `path` ("": the top level)."""
    prefix = f"{path}." if path else ""
    return tuple(sorted({key[len(prefix) :].split(".")[0] for key in DEEPSPEED_ONLY if key.startswith(prefix)}))


def _section_type(tp: Any) -> type | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next((a for a in typing.get_args(tp) if a is not type(None)), None)
    return tp if dataclasses.is_dataclass(tp) else None


def _split(cls: type, data: dict[str, Any], json_path: str, path: str, found: dict[str, Any]) -> dict[str, Any]:
    """`data` (section `cls`, at `json_path` as written and `path` by field names) without the DeepSpeed-only
    keys, which go to `found` by their dotted names."""
    fields = json_fields(cls)
    hints = typing.get_type_hints(cls)
    rest: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{json_path}.{key}" if json_path else key
        f = fields.get(key)
        if f is not None:
            inner = _section_type(hints[f.name])
            dotted = f"{path}.{f.name}" if path else f.name
            rest[key] = _split(inner, value, full, dotted, found) if inner and isinstance(value, dict) else value
            continue
        dotted = f"{path}.{key}" if path else key
        if not _is_root(dotted):
            raise unknown_key_error(full, json_path, key, list(fields), _names_under(path))
        found[dotted] = value
    return rest


def _value(found: dict[str, Any], key: str) -> Any:
    """The value of dotted `key` inside the DeepSpeed-only sections `found`; _ABSENT where it is not given."""
    for root, node in found.items():
        if key != root and not key.startswith(root + "."):
            continue
        where = root
        for part in key[len(root) + 1 :].split(".") if key != root else ():
            if not isinstance(node, dict):
                raise ConfigError(f"'{where}' must be an object (a JSON dict), got {node!r}")
            if part not in node:
                return _ABSENT
            node, where = node[part], f"{where}.{part}"
        return node
    return _ABSENT


def split_deepspeed_only(cls: type, data: dict[str, Any]) -> tuple[dict[str, Any], tuple[tuple[str, Any], ...]]:
    """`data` (a config for section `cls`, the whole config) without its DeepSpeed-only keys, and the
    (dotted key, value) of those that ask for something without effect here, for their notices.

    Raises ConfigError naming the key for a refused key that asks for something, a DeepSpeed-only section that
    is not an object, and a key neither infinity nor this table knows (with the closest of both).
    """
    found: dict[str, Any] = {}
    rest = _split(cls, data, "", "", found)
    noticed = []
    for key, entry in DEEPSPEED_ONLY.items():
        value = _value(found, key)
        if value is _ABSENT or not entry.asks(value):
            continue
        if entry.refused:
            raise ConfigError(f"'{key}' is {value!r}: {entry.why}")
        noticed.append((key, value))
    return rest, tuple(noticed)
