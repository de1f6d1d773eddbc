"""`infinity.initialize`: DeepSpeed's entry point, returning (engine, optimizer, dataloader, lr_scheduler)."""

from __future__ import annotations

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
    engine = InfinityEngine(model, config, model_parameters, optimizer, lr_scheduler)
    return engine, engine.optimizer, None, engine.lr_scheduler
