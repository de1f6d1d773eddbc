"""Example models that infinity trains as plain `nn.Module`s: a byte-level GPT and a small MLP."""

from infinity.models.gpt import GPT, GPT_PRESETS, Block, GPTConfig, count_params, gpt_preset
from infinity.models.mlp import MLP, MLPLayer

__all__ = ["GPT", "GPT_PRESETS", "Block", "GPTConfig", "MLP", "MLPLayer", "count_params", "gpt_preset"]
