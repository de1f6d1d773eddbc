"""Model shapes for a target parameter count: GPT (infinity.models.gpt) or Llama (infinity.models.llama)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

ARCHS = ("llama", "gpt")
BLOCK_CLASS = {"gpt": "Block", "llama": "LlamaBlock"}
_TOO_SMALL_TO_SCALE = {"gpt": ("tiny", "small", "gpt2-110m"), "llama": ("tiny",)}


def _family(arch: str) -> tuple[dict[str, Any], Any, Any]:
    """(presets, count(cfg), model class) of `arch`."""
    if arch == "gpt":
        from infinity.models.gpt import GPT, GPT_PRESETS, count_params

        return GPT_PRESETS, count_params, GPT
    if arch == "llama":
        from infinity.models.llama import LLAMA_PRESETS, Llama, count_llama_params

        return LLAMA_PRESETS, count_llama_params, Llama
    raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHS}")


def count(arch: str, cfg: Any) -> int:
    return _family(arch)[1](cfg)


def choose_shape(arch: str, target: float, preset: str | None, seq: int) -> tuple[Any, str]:
    """(config, how it was chosen): `preset` as is, else the width of the preset nearest `target` with n_layer
    set so that the count is nearest `target` (within half a layer of it)."""
    presets, count_fn, _ = _family(arch)
    if preset is not None:
        if preset not in presets:
            raise ValueError(f"unknown {arch} preset {preset!r}; choose from {sorted(presets)}")
        cfg, how = presets[preset], f"{arch} preset {preset!r} as asked"
    else:
        names = [n for n in presets if n not in _TOO_SMALL_TO_SCALE[arch]]
        name = min(names, key=lambda n: abs(math.log(count_fn(presets[n]) / target)))
        cfg = presets[name]
        per_layer = count_fn(replace(cfg, n_layer=2)) - count_fn(replace(cfg, n_layer=1))
        fixed = count_fn(replace(cfg, n_layer=1)) - per_layer
        n_layer = max(1, round((target - fixed) / per_layer))
        how = f"{arch} preset {name!r}" + ("" if n_layer == cfg.n_layer else f"'s width with n_layer {n_layer}")
        cfg = replace(cfg, n_layer=n_layer)
    if seq > cfg.block_size:
        cfg = replace(cfg, block_size=seq)
    return cfg, how


def build(arch: str, cfg: Any) -> nn.Module:
    """The model of `arch` with shape `cfg` (on the current default device: meta under infinity.Init)."""
    return _family(arch)[2](cfg)


def config_from_dict(arch: str, fields: dict[str, Any]) -> Any:
    """The config dataclass of `arch` from `dataclasses.asdict` output."""
    from infinity.models.gpt import GPTConfig
    from infinity.models.llama import LlamaConfig

    return {"gpt": GPTConfig, "llama": LlamaConfig}[arch](**fields)


def describe(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def largest_block_params(arch: str, cfg: Any) -> int:
    """Parameters of the engine's largest block: one layer, or the root (embeddings, final norm, head)."""
    total = count(arch, cfg)
    layer = count(arch, replace(cfg, n_layer=2)) - count(arch, replace(cfg, n_layer=1))
    return max(layer, total - cfg.n_layer * layer)
