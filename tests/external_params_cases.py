"""Models that read a block's parameters outside the block, and the rank function that trains them.

`gpt_head_reads_embedding`: the tiny GPT whose output head is `F.linear(x, self.wte.weight)` in the
parent's forward, with the embeddings made blocks of their own (block_classes Block and Embedding).
`peer_reads`: blocks reading other blocks' weights three ways (see `PeerReadNet`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from harness import config, rank_and_world, train_steps
from torch import nn
from toy_models import batches, make_model

import infinity
from infinity.partition.sharded_block import BlockState


class PeerLayer(nn.Module):
    """A block: gelu(fc(x)), plus `F.linear` of the result with a peer block's weight (held in a plain list,
    not registered) and with a weight handed in by the caller."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.peers: list[nn.Module] = []

    def forward(self, x: torch.Tensor, extra_weight: torch.Tensor | None = None) -> torch.Tensor:
        h = F.gelu(self.fc(x))
        for peer in self.peers:
            h = h + 0.5 * F.linear(h, peer.fc.weight)
        if extra_weight is not None:
            h = h + 0.5 * F.linear(h, extra_weight)
        return h


class PeerReadNet(nn.Module):
    """layers[2] reads layers[0]'s weight from inside its forward; the parent reads layers[1]'s weight and
    hands it to layers[3]; the parent calls layers[1].fc (a block's submodule) directly."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 24)
        self.layers = nn.ModuleList(PeerLayer(24) for _ in range(4))
        self.layers[2].peers.append(self.layers[0])
        self.head = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        h = self.inp(x)
        h = self.layers[0](h)
        h = self.layers[1](h)
        h = self.layers[2](h)
        h = self.layers[3](h, extra_weight=self.layers[1].fc.weight)
        h = h + 0.5 * self.layers[1].fc(h)
        out = self.head(h)
        return out, None if targets is None else F.mse_loss(out, targets)


def build_external(kind: str, seed: int = 0) -> nn.Module:
    if kind == "gpt_head_reads_embedding":
        return make_model("gpt_functional_tie", seed)
    torch.manual_seed(seed)
    model = PeerReadNet()
    if kind == "peer_reads_ahead":  # layers[0] also reads layers[3]'s weight: a reader before the owner
        model.layers[0].peers.append(model.layers[3])
    return model


def external_batches(kind: str, micro_bs: int, rank: int = 0, world_size: int = 1):
    return batches("gpt" if kind.startswith("gpt") else "mlp", micro_bs, rank=rank, world_size=world_size)


BLOCK_CLASSES = {"gpt_head_reads_embedding": ["Block", "Embedding"], "peer_reads": ["PeerLayer"],
                 "peer_reads_ahead": ["PeerLayer"]}  # fmt: skip


def external_config(kind: str, micro_bs: int, nvme_path: str, reuse_distance: int) -> dict:
    """Parameters and optimizer on NVMe, every parameter in a block or the root (none persistent)."""
    return config(
        micro_bs=micro_bs,
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=nvme_path,
        block_classes=tuple(BLOCK_CLASSES[kind]),
        extra_zero={"stage3_max_reuse_distance": reuse_distance},
    )


def train_external(kind: str, config: dict, steps: int, micro_bs: int) -> dict[str, Any]:
    """Train on this rank; losses, the full state, the forward trace, and for the GPT whether the embedding
    block was already on its way (prefetched) when the head was about to read it, per step."""
    rank, world = rank_and_world()
    model = build_external(kind)
    engine, _, _, _ = infinity.initialize(model=model, config=config)
    prefetched: list[bool] = []
    if kind.startswith("gpt"):
        wte = next(b for b in engine.blocks if b.name == "wte")
        model.ln_f.register_forward_pre_hook(lambda *_: prefetched.append(wte.state is not BlockState.SHARDED))
    data = external_batches(kind, micro_bs, rank, world)
    losses = train_steps(engine, data, steps)
    names = [b.name for b in engine.blocks]
    result = {
        "losses": losses,
        "state": engine.full_state_dict(),
        "order": [names[i] for i in engine.scheduler.forward_trace.order],
        "invalidations": engine.scheduler.forward_trace.invalidations,
        "prefetched": prefetched,
        "gathered_after": [b.name for b in engine.blocks if b.holds_memory],
    }
    engine.close()
    return result


def inference_external(kind: str, config: dict) -> dict[str, Any]:
    """A no-grad forward after initialize: its output, and whether any block stays gathered."""
    rank, world = rank_and_world()
    engine, _, _, _ = infinity.initialize(model=build_external(kind), config=config)
    x, _ = next(external_batches(kind, 2, rank, world))
    with torch.no_grad():
        out = engine(x)[0].clone()
    result = {"output": out, "gathered_after": [b.name for b in engine.blocks if b.holds_memory]}
    engine.close()
    return result

