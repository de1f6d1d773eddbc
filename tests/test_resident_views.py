"""A module that casts its own weights in forward (SwitchTransformers' router: `self.classifier =
self.classifier.to(torch.float32)` under bf16) replaces its parameters' data with a copy. Where the flat is
resident (one rank in memory, or stages 1-2), its parameters kept reading that copy of the first step's
weights while the steps updated the flat: each forward must read the weights of the last step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist import run_distributed
from harness import config, rank_and_world
from torch import nn
from toy_models import batches

import infinity


class SelfCastingLayer(nn.Module):
    """A block whose `router` is cast to fp32 by its own forward (as HF Switch's router does), the weights it
    used recorded in `used`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, dim)
        self.used: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.router = self.router.to(torch.float32)
        self.used = self.router.weight.detach().clone()
        return torch.tanh(x + self.router(x.float()).to(x.dtype))


class SelfCastingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 24)
        self.layers = nn.ModuleList([SelfCastingLayer(24), SelfCastingLayer(24)])
        self.head = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor, targets: torch.Tensor):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        out = self.head(h).float()
        return out, F.mse_loss(out, targets.float())


def _weights_each_forward_read(offload: str, stage: int, steps: int) -> list[float]:
    """Per step after the first, how far the weights layer 0's forward read are from the last step's (bf16)."""
    rank, world = rank_and_world()
    cfg = config("mlp", micro_bs=2, dtype="bf16", block_classes=("SelfCastingLayer",), offload_param=offload,
                 offload_optimizer=offload, extra_zero={"stage": stage})  # fmt: skip
    if stage < 3:
        cfg["zero_optimization"]["offload_param"] = {"device": "none"}
    engine, _, _, _ = infinity.initialize(model=SelfCastingNet(), config=cfg)
    data, gaps = batches("mlp", 2, rank=rank, world_size=world, dtype=torch.bfloat16), []
    for step in range(steps):
        if step > 0:
            expected = engine.full_state_dict()["layers.0.router.weight"].to(torch.bfloat16).float()
        _, loss = engine(*next(data))
        if step > 0:
            gaps.append((engine.module.layers[0].used - expected).abs().max().item())
        engine.backward(loss)
        engine.step()
    engine.close()
    return gaps


@pytest.mark.parametrize("world,offload,stage", [(1, "none", 3), (1, "cpu", 3), (2, "none", 2), (2, "cpu", 1)])
def test_a_module_casting_its_own_weights_reads_the_last_steps_weights(world, offload, stage):
    results = run_distributed(_weights_each_forward_read, world, offload, stage, 4)
    for gaps in results:
        assert gaps == [0.0, 0.0, 0.0], gaps
