"""`infinity estimate`: memory for model states at each ZeRO stage and offload, and what fits this machine; and
the line `infinity config` prints on whether a config's stage and offload fit. Both size a GPT preset or a
Hugging Face model folder as `infinity train` would build it, on the meta device."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from infinity.config import ConfigError, InfinityConfig, ZeroConfig
from infinity.estimator import (
    STAGE_CHOICES,
    ModelSize,
    advise,
    describe,
    fit_line,
    format_bytes,
    format_params,
    largest_fitting_params,
    module_size,
    probe_machine,
    size_from_params,
    stage_table,
)
from infinity.estimator.stages import choice_name, preferred
from infinity.models.gpt import GPT, GPT_PRESETS, gpt_preset
from infinity.shards.moments import MOMENT_FORMATS

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MODEL_HELP = f"a GPT preset ({', '.join(GPT_PRESETS)}) or a Hugging Face model folder"


@dataclass
class MetaModel:
    """A `--model` built on the meta device to be sized: its module, how to name it, its hidden size (for
    "auto" values) and the classes of its layers (None for a preset: the config's, `Block` by default)."""

    module: nn.Module
    label: str
    hidden_size: int | None
    block_classes: tuple[str, ...] | None


def unknown_model(name: str) -> ConfigError:
    return ConfigError(f"--model {name!r} is neither a GPT preset ({', '.join(GPT_PRESETS)}) nor a Hugging Face model "
                       "folder (a folder with config.json)")  # fmt: skip


def meta_model(name: str) -> MetaModel:
    """`name` (a GPT preset, or a folder with config.json) built on the meta device: no memory is allocated."""
    if name in GPT_PRESETS:
        preset = gpt_preset(name)
        with torch.device("meta"):
            module = GPT(preset)
        return MetaModel(module, f"GPT '{name}'", preset.n_embd, None)
    if not Path(name, "config.json").is_file():
        raise unknown_model(name)
    from infinity.models.hf import load_hf_folder

    hf = load_hf_folder(name, with_tokenizer=False)
    return MetaModel(hf.model, f"{type(hf.model).__name__} from {hf.folder}", hf.hidden_size, hf.block_classes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="total parameters, e.g. 13e9")
    what.add_argument("--model", help=f"{MODEL_HELP}, counted on the meta device")
    parser.add_argument(
        "--largest-layer-params", type=float, help="parameters of the largest block (default: GPT-shaped guess)"
    )
    parser.add_argument("--gpus", type=int, default=1, help="GPUs (ranks) per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(_DTYPE_BYTES), default="bf16", help="compute dtype of the weights")
    parser.add_argument("--moments", choices=MOMENT_FORMATS, default="fp32",
                        help="Adam's moments on an offloaded optimizer (offload_optimizer.moments)")  # fmt: skip
    parser.add_argument("--no-clip", action="store_true",
                        help="gradient clipping off (and not fp16): NVMe gradients are never written")  # fmt: skip
    parser.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--nvme-path", default=".", help="where NVMe offload would write (for its free space)")


def model_size(args: argparse.Namespace) -> tuple[ModelSize, str]:
    """`--params` (a GPT-shaped guess) or `--model`'s counts (blocks its layers, none persistent), and the model's
    name ("" for a bare count)."""
    label = ""
    if args.model:
        model = meta_model(args.model)
        zero = ZeroConfig(block_classes=model.block_classes or ("Block",), stage3_param_persistence_threshold=0)
        size, label = module_size(model.module, zero), f"{model.label}: "
    else:
        size = size_from_params(args.params)
    if args.largest_layer_params is not None:
        size = ModelSize(size.total_params, int(args.largest_layer_params))
    return size, label


def _check_counts(args: argparse.Namespace) -> None:
    """ConfigError unless the counts given are ones a model and a machine can have."""
    if args.gpus < 1 or args.nodes < 1 or args.accumulation < 1:
        raise ConfigError("--gpus, --nodes and --accumulation must be >= 1")
    for flag, value in (("--params", args.params), ("--largest-layer-params", args.largest_layer_params)):
        if value is not None and not (math.isfinite(value) and value >= 1):
            raise ConfigError(f"{flag} must be a positive finite number of parameters, got {value:g}")


def run(args: argparse.Namespace) -> int:
    """Print the stage table, what fits this machine and the largest model that fits; 0, or ConfigError."""
    _check_counts(args)
    size, label = model_size(args)
    dtype_bytes = _DTYPE_BYTES[args.dtype]
    clip = not args.no_clip or args.dtype == "fp16"
    choice = {"moments": args.moments, "clip": clip, "accumulation": args.accumulation}
    machine = probe_machine(args.nvme_path)
    print(
        f"Model states of {label}{format_params(size.total_params)} parameters (largest block "
        f"{format_params(size.largest_block_params)}), {args.nodes} node(s) x {args.gpus} GPU(s), "
        f"{args.dtype} weights, Adam moments {args.moments} (fp32 where the optimizer stays on the device), "
        f"gradient clipping {'on' if clip else 'off'}, {args.accumulation} micro-batch(es) per step; activations "
        "not included."
    )
    print(f"This machine: {describe(machine)}")
    rows = stage_table(size, machine, args.gpus, args.nodes, dtype_bytes, **choice)
    head = ("stage", "offload_param", "offload_optimizer", "per device", "host per node", "NVMe per node",
            "sent/rank/step", "fits here")  # fmt: skip
    widths = (5, 13, 17, 12, 14, 14, 14)
    print(" ".join(f"{h:>{w}}" for h, w in zip(head[:-1], widths, strict=True)) + f"  {head[-1]}")
    for row in rows:
        need = row.need
        print(
            f"{need.stage:>5} {need.offload_param:>13} {need.offload_optimizer:>17} "
            f"{format_bytes(need.device_bytes):>12} {format_bytes(need.host_bytes):>14} "
            f"{format_bytes(need.nvme_bytes):>14} {format_bytes(row.collective_bytes):>14}  "
            f"{'yes' if row.fits else 'no'}"
        )
    waiting = "keep the gradients that wait for the step there" if clip or args.accumulation > 1 else (
        "step each shard as its gradient arrives"
    )
    print(
        f"Rows with the optimizer on NVMe {waiting} and hold offload_optimizer.buffer_count shards of its state in "
        "host memory, as a run with zero_optimization.host_budget_bytes does. Without a budget, where the "
        "gradients fit a quarter of the memory available (per rank), they wait in host memory, the step runs "
        "before each shard's next forward, and its window grows into what is left of that quarter: such a run "
        f"may hold up to {format_bytes(machine.host_bytes // 4)} more per node here than its row says."
    )
    best = preferred(rows)
    print(
        f"Best fit here: {choice_name(best.key)}, the least traffic of those that fit"
        if best is not None
        else "Nothing fits here: add devices or nodes, free disk, or train a smaller model"
    )
    print(f"\nLargest GPT-shaped model whose states fit here ({machine.devices} rank(s), {args.dtype}):")
    largest = (0, "")
    for stage, param, optim in STAGE_CHOICES:
        moments = args.moments if optim != "none" else "fp32"
        n = largest_fitting_params(machine, param, optim, dtype_bytes=dtype_bytes, stage=stage, moments=moments,
                                   clip=clip, accumulation=args.accumulation)  # fmt: skip
        print(f"{stage:>5} {param:>13} {optim:>17} {format_params(n):>12}")
        if n > largest[0]:
            largest = (n, choice_name((stage, param, optim)))
    print(f"Largest overall: {format_params(largest[0])} parameters with {largest[1]}")
    return 0


def config_fit_line(cfg: InfinityConfig, model: MetaModel, world_size: int) -> str:
    """Whether `cfg`'s stage and offload (batch sizes and "auto" resolved) fit this machine for `model` on
    `world_size` ranks of this node, with the estimator's note (stage 3 where stage 2 fits, what fits where
    this does not, or that nothing does)."""
    z = cfg.zero_optimization
    paths = [s.nvme_path for s in (z.offload_param, z.offload_optimizer) if s.device == "nvme" and s.nvme_path]
    machine = probe_machine(paths[0] if paths else ".")
    choice = {
        "moments": z.offload_optimizer.moments,
        "clip": cfg.gradient_clipping > 0 or cfg.fp16.enabled is True,
        "accumulation": cfg.gradient_accumulation_steps,
    }
    dtype_bytes = 4 if cfg.compute_dtype_name == "float32" else 2
    try:
        size = module_size(model.module, zero=z)
        advice = advise(size, machine, z.stage, z.offload_param.device, z.offload_optimizer.device, world_size,
                        dtype_bytes=dtype_bytes, **choice)  # fmt: skip
    except ValueError as exc:  # a stage or offload the engine refuses too
        return f"fit: not estimated: {exc}"
    return "fit: " + fit_line(advice, machine, f"{model.label} on {world_size} rank(s)")
