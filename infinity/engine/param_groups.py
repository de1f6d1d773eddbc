"""Optimizer hyper-parameters per param group, from a client optimizer, model_parameters or the config."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from infinity.config import ConfigError, OptimizerConfig

_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_CONFIG_KEYS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "amsgrad", "bias_correction"}


@dataclass
class GroupPlan:
    """Hyper-parameters of each group, the group index of every trainable parameter, and the Adam flavour."""

    groups: list[dict[str, Any]]
    group_of: dict[int, int]  # id(param) -> group index; frozen parameters are absent
    adamw_mode: bool


def _hyper(source: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    out = {k: source.get(k, base[k]) for k in _DEFAULTS}
    out["betas"] = tuple(out["betas"])
    return out


def _from_config(cfg: OptimizerConfig | None) -> tuple[dict[str, Any], bool]:
    if cfg is None:
        return dict(_DEFAULTS), True
    params = dict(cfg.params)
    unknown = set(params) - _CONFIG_KEYS
    if unknown:
        raise ConfigError(f"'optimizer.params' has unknown key(s) {sorted(unknown)}; known: {sorted(_CONFIG_KEYS)}")
    if params.get("amsgrad"):
        raise ConfigError("'optimizer.params.amsgrad' = true is not supported; remove it or set it to false")
    if params.get("bias_correction") is False:
        raise ConfigError("'optimizer.params.bias_correction' = false is not supported")
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false; "AdamW" always is.
    adamw = cfg.type.lower() == "adamw" or bool(params.get("adam_w_mode", True))
    return _hyper(params, _DEFAULTS), adamw


def _from_client(optimizer: torch.optim.Optimizer) -> tuple[list[dict[str, Any]], list[list[nn.Parameter]], bool]:
    name = type(optimizer).__name__
    if name not in ("Adam", "AdamW", "CPUAdam", "CPUAdamW"):
        raise ConfigError(
            f"optimizer {name} is not supported: infinity steps sharded state with its own Adam/AdamW; "
            "pass torch.optim.Adam/AdamW or configure 'optimizer' in the config"
        )
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize"):
            raise ConfigError(f"{name} with amsgrad or maximize is not supported")
    adamw = name in ("AdamW", "CPUAdamW") or bool(
        getattr(optimizer, "adamw_mode", False) or optimizer.defaults.get("decoupled_weight_decay", False)
    )
    groups = [_hyper(g, _DEFAULTS) for g in optimizer.param_groups]
    params = [list(g["params"]) for g in optimizer.param_groups]
    return groups, params, adamw


def plan_groups(
    model: nn.Module,
    cfg: OptimizerConfig | None,
    model_parameters: Iterable | None,
    optimizer: torch.optim.Optimizer | None,
) -> GroupPlan:
    """Decide the param groups; parameters outside every group are treated as frozen."""
    if optimizer is not None:
        groups, params, adamw = _from_client(optimizer)
    else:
        base, adamw = _from_config(cfg)
        if model_parameters is None:
            entries = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        else:
            entries = list(model_parameters)
            if entries and not isinstance(entries[0], dict):
                entries = [{"params": entries}]
        groups = [_hyper(e, base) for e in entries]
        params = [list(e["params"]) for e in entries]
    group_of: dict[int, int] = {}
    for index, group_params in enumerate(params):
        for p in group_params:
            if id(p) in group_of:
                raise ConfigError("a parameter appears in more than one optimizer param group")
            if p.requires_grad:
                group_of[id(p)] = index
    for index, g in enumerate(groups):
        if not (g["lr"] >= 0 and 0 <= g["betas"][0] < 1 and 0 <= g["betas"][1] < 1 and g["eps"] > 0):
            raise ConfigError(f"optimizer param group {index} has invalid hyper-parameters {g}")
    return GroupPlan(groups=groups, group_of=group_of, adamw_mode=adamw)
