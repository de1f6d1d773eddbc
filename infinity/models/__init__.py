"""Example models that infinity trains as plain `nn.Module`s: a byte-level GPT, a Llama-shaped decoder, an MLP."""

from infinity.models.gpt import GPT, GPT_PRESETS, Block, GPTConfig, count_params, gpt_preset
from infinity.models.llama import LLAMA_PRESETS, Llama, LlamaBlock, LlamaConfig, count_llama_params, llama_preset
from infinity.models.mlp import MLP, MLPLayer

__all__ = [
    "GPT",
    "GPT_PRESETS",
    "LLAMA_PRESETS",
    "MLP",
    "Block",
    "GPTConfig",
    "Llama",
    "LlamaBlock",
    "LlamaConfig",
    "MLPLayer",
    "count_llama_params",
    "count_params",
    "gpt_preset",
    "llama_preset",
]
