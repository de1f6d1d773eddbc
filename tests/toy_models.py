"""The models and data the engine tests train, by kind: `make_model(kind, seed)` and `batches(kind, ...)`.

Every model is built from a seed, so each call gives the same weights (the plain-PyTorch reference builds
its own copy). GPTs use bias=False: the attention key bias has a mathematically zero gradient, so Adam
turns its rounding noise into full-size updates and no two implementations agree on it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from infinity.data.corpus import ByteBatches, load_corpus
from infinity.models.gpt import GPT, gpt_preset
from infinity.models.mlp import MLP, MLPLayer

SEQ = 16


class ReusedLayerNet(nn.Module):
    """One MLPLayer (a block) applied twice per forward, at two depths, with the same weights."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = MLPLayer(16, 24)
        self.shared = MLPLayer(24, 24)
        self.out = MLPLayer(24, 24)
        self.head = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        h = self.shared(self.shared(self.inp(x)))
        out = self.head(self.out(h))
        return out, None if targets is None else F.mse_loss(out, targets)


class SharedLinearNet(nn.Module):
    """One nn.Linear registered in two different blocks (layers.1.fc is layers.2.fc)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MLPLayer(16, 24), MLPLayer(24, 24), MLPLayer(24, 24), MLPLayer(24, 24)])
        self.layers[2].fc = self.layers[1].fc
        self.head = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        for layer in self.layers:
            x = layer(x)
        out = self.head(x)
        return out, None if targets is None else F.mse_loss(out, targets)


class TwiceLayer(nn.Module):
    """A block that calls its one linear layer twice."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(F.gelu(self.fc(x))))


class ReadBackLayer(nn.Module):
    """A block that calls its linear layer and also reads the layer's weight itself (`F.linear`)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x)) + 0.5 * F.linear(x, self.fc.weight)


class TiedLayer(nn.Module):
    """A block whose linear weight is also its embedding's (tied), the embedding's share of its gradient small."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.emb = nn.Embedding(width, width)
        self.emb.weight = self.fc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x)) + 1e-4 * self.emb(x.argmax(-1))


class LayersThenHead(nn.Module):
    """`layers` in turn, then a linear `head`, an MSE loss with `targets` (the wide nets below)."""

    def __init__(self, layers: list[nn.Module], width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        for layer in self.layers:
            x = layer(x)
        out = self.head(x)
        return out, None if targets is None else F.mse_loss(out, targets)


class HookedWideNet(LayersThenHead):
    """1024 features in; blocks: a `TiedLayer`, an MLPLayer whose linear has a forward hook doubling its output,
    and one whose linear's forward is replaced on the instance (halving its input)."""

    def __init__(self) -> None:
        super().__init__([TiedLayer(1024), MLPLayer(1024, 1024), MLPLayer(1024, 1024)], 1024)
        self.layers[1].fc.register_forward_hook(lambda module, args, out: 2 * out)
        plain = self.layers[2].fc.forward
        self.layers[2].fc.forward = lambda x: plain(0.5 * x)


class TwiceWideNet(LayersThenHead):
    """mlp_wide's shape with a `TwiceLayer` and a `ReadBackLayer` in the middle (blocks: MLPLayer, TwiceLayer,
    ReadBackLayer, MLPLayer)."""

    def __init__(self) -> None:
        super().__init__([MLPLayer(16, 1024), TwiceLayer(1024), ReadBackLayer(1024), MLPLayer(1024, 1024)], 1024)
        with torch.no_grad():  # a gentler start: the default init makes the first steps overshoot
            self.layers[1].fc.weight.mul_(0.25)
            self.layers[2].fc.weight.mul_(0.25)


class ScaledLayer(nn.Module):
    """A block with buffers used in forward: a fixed per-feature scale, a non-persistent position-id buffer
    and a running mean of |activation| that forward updates in training mode (as BatchNorm's stats)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, n_out))
        self.register_buffer("pos_ids", torch.arange(n_out), persistent=False)
        self.register_buffer("running", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * self.scale + 0.01 * self.pos_ids
        if self.training:
            with torch.no_grad():
                self.running.mul_(0.5).add_(0.5 * h.abs().mean())
        return F.gelu(h / self.running)


class BufferNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ScaledLayer(16, 24), ScaledLayer(24, 24)])
        self.head = nn.Linear(24, 8)
        self.register_buffer("out_shift", torch.full((8,), 0.25))

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        for layer in self.layers:
            x = layer(x)
        out = self.head(x) + self.out_shift
        return out, None if targets is None else F.mse_loss(out, targets)


class SkippingMLP(MLP):
    """An MLP whose forward skips layers[1] when asked (`skip=True`): the block order changes between steps."""

    def __init__(self) -> None:
        super().__init__(in_features=16, hidden=24, out_features=8, n_layers=4)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, skip: bool = False):
        for i, layer in enumerate(self.layers):
            if not (skip and i == 1):
                x = layer(x)
        out = self.head(x)
        return out, None if targets is None else F.mse_loss(out, targets)


class LoRALayer(nn.Module):
    """A block as LoRA fine-tuning makes it: a frozen base projection and a trainable low-rank adapter. The
    adapter's gradients arrive before backward reads the frozen base to carry the gradient to the input."""

    def __init__(self, dim: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(dim, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + self.base(x) + x @ self.lora_a.t() @ self.lora_b.t())


class LoRANet(nn.Module):
    """Three LoRALayer blocks between a trainable input projection and head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 24)
        self.layers = nn.ModuleList([LoRALayer(24) for _ in range(3)])
        self.head = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        out = self.head(x)
        return out, None if targets is None else F.mse_loss(out, targets)


class CrossLoRALayer(LoRALayer):
    """A LoRALayer that also reads a context every block shares (a decoder's encoder states)."""

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x if ctx is None else x + ctx)


class CrossLoRANet(LoRANet):
    """Six CrossLoRALayer blocks, each given the same trainable context from the root: the context's gradient is
    complete only after the last of them, while each block's own use of it is done in its own backward."""

    def __init__(self) -> None:
        super().__init__()
        self.ctx = nn.Linear(16, 24)
        self.layers = nn.ModuleList([CrossLoRALayer(24) for _ in range(6)])

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        ctx, h = self.ctx(x), self.inp(x)
        for layer in self.layers:
            h = layer(h, ctx=ctx)
        out = self.head(h)
        return out, None if targets is None else F.mse_loss(out, targets)


class FrozenBranchNet(nn.Module):
    """A trainable block, a wholly frozen block computed every step whose output only some steps' loss uses
    (`use_branch`), and another trainable block."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 24)
        self.first, self.branch, self.last = MLPLayer(24, 24), MLPLayer(24, 24), MLPLayer(24, 24)
        self.branch.requires_grad_(False)
        self.head = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, use_branch: bool = True):
        h = self.first(self.inp(x))
        side = self.branch(h)
        out = self.head(self.last(h + side if use_branch else h))
        return out, None if targets is None else F.mse_loss(out, targets)


class ExpertLayer(nn.Module):
    """A block of three experts: each row goes through the expert its route names. An expert no row of a batch
    is routed to is not called, so it gets no gradient in that step, while the others in the block do."""

    def __init__(self, dim: int, n_experts: int = 3) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(dim, dim) for _ in range(n_experts)])

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (route == i).nonzero(as_tuple=True)[0]
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]))
        return torch.tanh(x + out)


def expert_route(x: torch.Tensor) -> torch.Tensor:
    """Each row's expert, from its first input feature (the data alone decides, on every side alike)."""
    return (x[:, 0].float() * 2).floor().remainder(3).long()


class ExpertNet(nn.Module):
    """An input projection, two ExpertLayer blocks and a head; `pooler`, a root layer the loss never uses (as
    a masked-LM loss leaves out BERT's pooler), gets no gradient ever. `skip=True` leaves layers[1] out."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 24)
        self.layers = nn.ModuleList([ExpertLayer(24), ExpertLayer(24)])
        self.pooler = nn.Linear(24, 24)
        self.head = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, skip: bool = False):
        route = expert_route(x)
        h = self.inp(x)
        for i, layer in enumerate(self.layers):
            if not (skip and i == 1):
                h = layer(h, route)
        out = self.head(h)
        return out, None if targets is None else F.mse_loss(out, targets)


class ReentrantLoRANet(LoRANet):
    """LoRANet with each block under torch.utils.checkpoint(use_reentrant=True); the same weights."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.inp(x)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=True) if torch.is_grad_enabled() else layer(x)
        out = self.head(x)
        return out, None if targets is None else F.mse_loss(out, targets)


class EmbedOutsideNet(nn.Module):
    """A root input projection and two MLPLayer blocks; `forward(h, y, embedded=True)` takes inputs already
    projected by `self.inp` (as a user computing `inputs_embeds` before the engine's forward), the same math."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 24)
        self.layers = nn.ModuleList([MLPLayer(24, 24), MLPLayer(24, 24)])
        self.head = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, embedded: bool = False):
        h = x if embedded else self.inp(x)
        for layer in self.layers:
            h = layer(h)
        out = self.head(h)
        return out, None if targets is None else F.mse_loss(out, targets)


class ReentrantCheckpointGPT(GPT):
    """The tiny GPT with each block under torch.utils.checkpoint(use_reentrant=True): the first forward runs
    the blocks without autograd, and backward re-runs each block's forward before its backward."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True) if torch.is_grad_enabled() else block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


# mlp4 with layers[1] (a whole block), layers[2].fc.bias (part of a block) and head.bias frozen
FROZEN = ("layers.1.fc.weight", "layers.1.fc.bias", "layers.2.fc.bias", "head.bias")

GPT_KINDS = {
    "gpt": {},
    "gpt_functional_tie": {"tied_head_functional": True},  # wte.weight used through F.linear outside its module
    "gpt_checkpointed": {"activation_checkpointing": True},
    # wide for the few tokens of a micro-batch: its blocks' weight gradients are kept as factors (linear_factors)
    "gpt_wide": {"n_embd": 768, "n_head": 4},
    "gpt_wide_checkpointed": {"n_embd": 768, "n_head": 4, "activation_checkpointing": True},
}


def make_model(kind: str, seed: int = 0) -> nn.Module:
    """The model `kind` names, its weights drawn from `seed`."""
    torch.manual_seed(seed)
    if kind in GPT_KINDS:
        return GPT(gpt_preset("tiny", bias=False, block_size=SEQ, **GPT_KINDS[kind]))
    if kind == "gpt_reentrant":  # the same weights as "gpt"
        return ReentrantCheckpointGPT(gpt_preset("tiny", bias=False, block_size=SEQ))
    if kind == "mlp":
        return MLP(in_features=16, hidden=24, out_features=8, n_layers=3)
    if kind == "mlp_h40":
        return MLP(in_features=16, hidden=40, out_features=8, n_layers=3)
    if kind == "mlp4":
        return MLP(in_features=16, hidden=24, out_features=8, n_layers=4)
    if kind == "mlp_wide":  # a few rows against 1024 features: the hidden layers' gradients are kept as factors
        return MLP(in_features=16, hidden=1024, out_features=8, n_layers=3)
    if kind == "odd":  # 7x13, 5x7 ...: no size divides by 2, nor by the 1024-element shard alignment
        return MLP(in_features=13, hidden=7, out_features=5, n_layers=3)
    if kind == "frozen":
        model = make_model("mlp4", seed)
        for name, p in model.named_parameters():
            p.requires_grad_(name not in FROZEN)
        return model
    models = {"reused": ReusedLayerNet, "shared_linear": SharedLinearNet, "buffers": BufferNet, "skipping": SkippingMLP,
              "lora": LoRANet, "lora_reentrant": ReentrantLoRANet, "embed_outside": EmbedOutsideNet,
              "lora_cross": CrossLoRANet, "frozen_branch": FrozenBranchNet, "experts": ExpertNet,
              "twice_wide": TwiceWideNet, "hooked_wide": HookedWideNet}  # fmt: skip
    return models[kind]()


def io_sizes(kind: str) -> tuple[int, int]:
    return {"odd": (13, 5), "hooked_wide": (1024, 8)}.get(kind, (16, 8))


def batches(
    kind: str, micro_bs: int, seed: int = 0, rank: int = 0, world_size: int = 1, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic micro-batches for `kind`: bytes of the corpus for GPTs, random regression rows otherwise.

    Rank r's rows of global micro-batch s are rows [r*b, (r+1)*b), so the global batches of world size 1 with
    `micro_bs` N*b are the ranks' batches concatenated in rank order."""
    if kind.startswith("gpt"):
        yield from ByteBatches(load_corpus(), micro_bs, SEQ, seed=seed, rank=rank, world_size=world_size)
        return
    n_in, n_out = io_sizes(kind)
    step = 0
    while True:
        gen = torch.Generator().manual_seed(seed * 7919 + step)
        x = torch.randn(micro_bs * world_size, n_in, generator=gen)
        y = torch.randn(micro_bs * world_size, n_out, generator=gen)
        rows = slice(rank * micro_bs, (rank + 1) * micro_bs)
        yield x[rows].to(dtype), y[rows].to(dtype)
        step += 1


def dropout_gpt(p: float = 0.2) -> nn.Module:
    """The "gpt" model (seed 0) with every dropout, the attention's own included, at `p`."""
    model = make_model("gpt")
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = p
    for block in model.blocks:
        block.attn.dropout = p
    return model
