"""`infinity estimate`: memory for model states under each offload choice, and what fits this machine."""

from __future__ import annotations

import argparse

from infinity.config import ConfigError
from infinity.estimator import (
    OFFLOAD_CHOICES,
    ModelSize,
    estimate,
    fits,
    format_bytes,
    format_params,
    gpt_model_size,
    largest_fitting_params,
    probe_machine,
    size_from_params,
)
from infinity.models.gpt import GPT_PRESETS

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="total parameters, e.g. 13e9")
    what.add_argument("--model", choices=list(GPT_PRESETS), help="a GPT preset, counted on the meta device")
    parser.add_argument(
        "--largest-layer-params", type=float, help="parameters of the largest block (default: GPT-shaped guess)"
    )
    parser.add_argument("--gpus", type=int, default=1, help="GPUs (ranks) per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(_DTYPE_BYTES), default="bf16", help="compute dtype of the weights")
    parser.add_argument("--nvme-path", default=".", help="where NVMe offload would write (for its free space)")


def model_size(args: argparse.Namespace) -> ModelSize:
    size = gpt_model_size(args.model) if args.model else size_from_params(args.params)
    if args.largest_layer_params is not None:
        size = ModelSize(size.total_params, int(args.largest_layer_params))
    return size


def run(args: argparse.Namespace) -> int:
    if args.gpus < 1 or args.nodes < 1:
        raise ConfigError("--gpus and --nodes must be >= 1")
    size = model_size(args)
    dtype_bytes = _DTYPE_BYTES[args.dtype]
    machine = probe_machine(args.nvme_path)
    print(
        f"Model states of {format_params(size.total_params)} parameters (largest block "
        f"{format_params(size.largest_block_params)}), {args.nodes} node(s) x {args.gpus} GPU(s), "
        f"{args.dtype} weights, fp32 Adam; activations not included."
    )
    header = ("offload_param", "offload_optimizer", "per device", "host per node", "NVMe per node")
    print(f"{header[0]:>13} {header[1]:>17} {header[2]:>12} {header[3]:>14} {header[4]:>14}")
    for param_dev, optim_dev in OFFLOAD_CHOICES:
        need = estimate(size, param_dev, optim_dev, args.gpus, args.nodes, dtype_bytes)
        print(
            f"{param_dev:>13} {optim_dev:>17} {format_bytes(need.device_bytes):>12} "
            f"{format_bytes(need.host_bytes):>14} {format_bytes(need.nvme_bytes):>14}"
        )
    device = (
        f"{machine.devices} GPU(s) of {format_bytes(machine.device_bytes)}"
        if machine.device_bytes is not None
        else "no GPU (the device tier is host memory)"
    )
    print(
        f"\nThis machine: {device}, {format_bytes(machine.host_bytes)} host memory available, "
        f"{format_bytes(machine.nvme_bytes)} free disk at {machine.nvme_path}"
    )
    print(f"Largest GPT-shaped model whose states fit here ({machine.devices} rank(s), {args.dtype}):")
    best = (0, "")
    for param_dev, optim_dev in OFFLOAD_CHOICES:
        n = largest_fitting_params(machine, param_dev, optim_dev, dtype_bytes=dtype_bytes)
        this = estimate(size, param_dev, optim_dev, machine.devices, 1, dtype_bytes)
        verdict = "fits" if fits(this, machine) else "does not fit"
        print(f"{param_dev:>13} {optim_dev:>17} {format_params(n):>12}   (this model {verdict})")
        if n > best[0]:
            best = (n, f"offload_param={param_dev}, offload_optimizer={optim_dev}")
    print(f"Largest overall: {format_params(best[0])} parameters with {best[1]}")
    return 0
