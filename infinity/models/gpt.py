"""A small GPT in the style of nanoGPT: byte-level, pre-LN, tied output head.

A plain `nn.Module` that infinity trains without edits. Two tying styles are offered because offload
trainers must handle both: a `lm_head` Linear sharing the embedding's weight (`tie_weights`), or the
embedding weight used directly through `F.linear` outside its module (`tied_head_functional`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """Shape and options of a GPT; `vocab_size=256` means raw bytes are the tokens."""

    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    vocab_size: int = 256
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    tied_head_functional: bool = False
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; pick a divisor")
        if self.tied_head_functional and not self.tie_weights:
            raise ValueError("tied_head_functional=True needs tie_weights=True: it is a way of tying the head")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.init_std = INIT_STD / math.sqrt(2 * cfg.n_layer)  # GPT-2: scale residual projections
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.init_std = INIT_STD / math.sqrt(2 * cfg.n_layer)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One transformer layer, pre-LN; the unit infinity schedules and swaps."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """`forward(idx, targets=None) -> (logits, loss)`; loss is mean cross-entropy, targets of -1 ignored."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        if not cfg.tied_head_functional:
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.apply(self.init_module_weights)

    def tie_weights(self) -> None:
        """(Re-)share the head's weight with the embedding; call again after anything that unties them."""
        if self.config.tie_weights and not self.config.tied_head_functional:
            self.lm_head.weight = self.wte.weight
            self.lm_head.weight_is_tied = True  # init_module_weights leaves it to wte

    @staticmethod
    def init_module_weights(module: nn.Module) -> None:
        """Initialize `module`'s own parameters (not its children's) as nanoGPT does.

        Linear: N(0, 0.02), or N(0, 0.02/sqrt(2*n_layer)) for residual projections (their `init_std`);
        Embedding: N(0, 0.02); LayerNorm: ones/zeros; biases zero. A tied head is skipped (wte owns it).
        `GPT.__init__` applies it to every module; a trainer that builds the model on the meta device
        calls it on each module after materializing that module's parameters (instead of reset_parameters).
        """
        with torch.no_grad():
            if isinstance(module, nn.Linear):
                if not getattr(module, "weight_is_tied", False):
                    nn.init.normal_(module.weight, mean=0.0, std=getattr(module, "init_std", INIT_STD))
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            elif isinstance(module, nn.LayerNorm):
                if module.weight is not None:
                    nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}; crop the input")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            if self.config.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight) if self.config.tied_head_functional else self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss


def count_params(cfg: GPTConfig) -> int:
    """Number of distinct parameters of `GPT(cfg)`, tied weights counted once."""
    C, bias = cfg.n_embd, int(cfg.bias)
    layer_norm = C * (1 + bias)
    block = 2 * layer_norm + 12 * C * C + bias * (3 * C + C + 4 * C + C)  # c_attn, c_proj, c_fc, c_proj
    head = 0 if cfg.tie_weights else cfg.vocab_size * C
    return (cfg.vocab_size + cfg.block_size) * C + cfg.n_layer * block + layer_norm + head


# Byte vocab (256) makes embeddings tiny, so layer counts are chosen to hit each advertised size.
# Counts from count_params: tiny 34,688; small 1,239,040; 110m 107,302,656; 1b 1,011,888,128;
# 3b 2,995,609,600; 7b 7,057,739,776; 13b 12,912,020,480. Big presets are meant for the meta device.
GPT_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
    "small": GPTConfig(block_size=128, n_layer=6, n_head=4, n_embd=128),
    "110m": GPTConfig(block_size=1024, n_layer=15, n_head=12, n_embd=768),
    "1b": GPTConfig(block_size=2048, n_layer=20, n_head=16, n_embd=2048),
    "3b": GPTConfig(block_size=2048, n_layer=38, n_head=20, n_embd=2560),
    "7b": GPTConfig(block_size=2048, n_layer=35, n_head=32, n_embd=4096),
    "13b": GPTConfig(block_size=2048, n_layer=41, n_head=40, n_embd=5120),
}
GPT_PRESETS["gpt2-110m"] = GPT_PRESETS["110m"]


def gpt_preset(name: str, **overrides) -> GPTConfig:
    """The preset `name` with fields replaced by `overrides` (e.g. activation_checkpointing=True)."""
    if name not in GPT_PRESETS:
        raise KeyError(f"unknown GPT preset {name!r}; choose one of {sorted(GPT_PRESETS)}")
    return replace(GPT_PRESETS[name], **overrides)
