"""`infinity.initialize`: DeepSpeed's entry point, returning (engine, optimizer, dataloader, lr_scheduler)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.engine.engine import InfinityEngine


def initialize(
    model: nn.Module,
    config: InfinityConfig | dict | str | None = None,
    model_parameters: Iterable | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
) -> tuple[InfinityEngine, torch.optim.Optimizer, None, Any]:
    """Shard `model` per `config` (a dict, a JSON path or an InfinityConfig) and build its optimizer.

    `optimizer` may be a torch Adam/AdamW whose param groups and hyper-parameters are used;
    `lr_scheduler` may be a scheduler object or a callable taking the engine's optimizer.
    """
    model_parameters = check_arguments(model, config, model_parameters, optimizer, lr_scheduler)
    engine = InfinityEngine(model, config, model_parameters, optimizer, lr_scheduler)
    return engine, engine.optimizer, None, engine.lr_scheduler


def check_arguments(model: Any, config: Any, model_parameters: Any, optimizer: Any, lr_scheduler: Any) -> list | None:
    """Refuse arguments `initialize` cannot train with, naming the argument; `model_parameters` as a list."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    if config is not None and not isinstance(config, InfinityConfig | dict | str | os.PathLike):
        raise TypeError(
            "initialize: config must be a dict, a path to a JSON file or an InfinityConfig, got "
            f"{type(config).__name__}"
        )
    if model_parameters is not None:
        if isinstance(model_parameters, str | bytes) or not isinstance(model_parameters, Iterable):
            raise TypeError(
                "initialize: model_parameters must be an iterable of parameters or of param-group dicts, got "
                f"{type(model_parameters).__name__}"
            )
        model_parameters = [_listed(e) if isinstance(e, dict) else e for e in model_parameters]  # read once here
        groups = [e for e in model_parameters if isinstance(e, dict)] or [{"params": model_parameters}]
        _check_own(model, groups, "model_parameters")
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"initialize: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        _check_own(model, optimizer.param_groups, "the optimizer")
    if lr_scheduler is not None and not (hasattr(lr_scheduler, "step") or callable(lr_scheduler)):
        raise TypeError(
            "initialize: lr_scheduler must be a scheduler (with step()) or a callable taking the optimizer, got "
            f"{type(lr_scheduler).__name__}"
        )
    return model_parameters


def _check_own(model: nn.Module, groups: list[dict], what: str) -> None:
    own = {id(p) for p in model.parameters()}
    if any(not isinstance(p, torch.Tensor) or id(p) not in own for group in groups for p in group.get("params", ())):
        raise ValueError(
            f"initialize: {what} holds tensors that are not this model's parameters; build it from "
            "model.parameters() (or param groups of them)"
        )


def _listed(group: dict) -> dict:
    params = group.get("params", [])
    return {**group, "params": [params] if isinstance(params, torch.Tensor) else list(params)}
