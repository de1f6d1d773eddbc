"""A small multi-layer perceptron for engine correctness tests: cheap, deterministic, several blocks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLPLayer(nn.Module):
    """Linear followed by GELU; each one is a block for infinity's scheduler."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class MLP(nn.Module):
    """`n_layers` MLPLayers then a Linear head; `forward(x, targets=None) -> (out, mse_loss or None)`."""

    def __init__(
        self, in_features: int = 16, hidden: int = 32, out_features: int = 8, n_layers: int = 3, bias: bool = True
    ) -> None:
        super().__init__()
        widths = [in_features] + [hidden] * n_layers
        self.layers = nn.ModuleList(MLPLayer(a, b, bias) for a, b in zip(widths[:-1], widths[1:], strict=True))
        self.head = nn.Linear(widths[-1], out_features, bias=bias)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        for layer in self.layers:
            x = layer(x)
        out = self.head(x)
        return out, None if targets is None else F.mse_loss(out, targets)
