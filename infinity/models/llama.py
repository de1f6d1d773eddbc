"""A Llama-shaped decoder: pre-RMSNorm, SwiGLU feed-forward, rotary positions, no biases, untied head.

Byte vocabulary by default, like the GPT beside it. The rotary angles are computed in forward (no
buffers), so the model builds on the meta device and infinity materializes it block by block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

INIT_STD = 0.02


def llama_ffn_hidden(n_embd: int, multiple_of: int = 256) -> int:
    """Llama's feed-forward width: 2/3 of 4 * n_embd, rounded up to a multiple of `multiple_of`."""
    return multiple_of * math.ceil(int(8 * n_embd / 3) / multiple_of)


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama; `ffn_hidden=None` takes Llama's rule (`llama_ffn_hidden`)."""

    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    ffn_hidden: int | None = None
    vocab_size: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"n_embd={self.n_embd} / n_head={self.n_head} must be a whole, even head size for rotary positions"
            )

    @property
    def hidden(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else llama_ffn_hidden(self.n_embd)


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate each (i, i + d/2) pair of x's last dim (B, H, T, d) by position t times theta^(-2i/d)."""
    T, d = x.shape[-2], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wo = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wo.init_std = INIT_STD / math.sqrt(2 * cfg.n_layer)  # residual projections scaled, as GPT-2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (w(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q, self.rope_theta), rotary(k, self.rope_theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.n_embd, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.n_embd, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.n_embd, bias=False)
        self.w2.init_std = INIT_STD / math.sqrt(2 * cfg.n_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """One decoder layer; the unit infinity schedules and swaps (block_classes ["LlamaBlock"])."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """`forward(idx, targets=None) -> (logits, loss)`; loss is mean cross-entropy, targets of -1 ignored."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self.init_module_weights)

    @staticmethod
    def init_module_weights(module: nn.Module) -> None:
        """Initialize `module`'s own parameters: Linear N(0, 0.02) (residual projections their `init_std`),
        Embedding N(0, 0.02), RMSNorm ones. Also what the engine calls after materializing a meta module."""
        with torch.no_grad():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=getattr(module, "init_std", INIT_STD))
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if idx.size(1) > self.config.block_size:
            raise ValueError(f"sequence length {idx.size(1)} exceeds block_size={self.config.block_size}; crop it")
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss


def count_llama_params(cfg: LlamaConfig) -> int:
    """Number of parameters of `Llama(cfg)`."""
    C = cfg.n_embd
    layer = 4 * C * C + 3 * C * cfg.hidden + 2 * C
    return 2 * cfg.vocab_size * C + cfg.n_layer * layer + C


# Shapes of Llama 7B, OpenLLaMA 3B and TinyLlama 1.1B with a byte vocabulary (256): 7b has 6,478,368,768 parameters
# (Llama 7B's 6.74e9 less its 32,000-token embeddings); take n_layer=34 for more than 6.7e9.
LLAMA_PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, ffn_hidden=64),
    "small": LlamaConfig(block_size=128, n_layer=6, n_head=4, n_embd=128, ffn_hidden=344),
    "1b": LlamaConfig(block_size=2048, n_layer=22, n_head=32, n_embd=2048, ffn_hidden=5632),
    "3b": LlamaConfig(block_size=2048, n_layer=26, n_head=32, n_embd=3200, ffn_hidden=8640),
    "7b": LlamaConfig(block_size=2048, n_layer=32, n_head=32, n_embd=4096),
}


def llama_preset(name: str, **overrides) -> LlamaConfig:
    """The preset `name` with fields replaced by `overrides`."""
    if name not in LLAMA_PRESETS:
        raise KeyError(f"unknown Llama preset {name!r}; choose one of {sorted(LLAMA_PRESETS)}")
    return replace(LLAMA_PRESETS[name], **overrides)
