"""`infinity.Init`: build a model too large for memory without ever holding it.

Inside the context, parameters are created on the meta device (shapes, no storage). `initialize`
then materializes the model block by block with its own initializers, shards and offloads each
block before the next exists, so the full model never lives in host or device memory.

Buffers keep their values by default, as under DeepSpeed's `zero.Init`: a module computes some at
construction (a rotary embedding's inverse frequencies, a causal mask) and nothing could recompute them
later. So only parameters go to the meta device, each as it is registered (`parameters_on_meta`, as a
Hugging Face folder is built): its `torch.empty` storage is dropped untouched, and the initializers that
run after registration run on the meta copy. A module that fills a parameter before registering it
(`nn.Parameter(torch.randn(...))`) pays for that one tensor while it is built.
"""

from __future__ import annotations

import contextlib

import torch

from infinity.config import InfinityConfig, load_config
from infinity.models.meta import parameters_on_meta


class Init:
    """`with infinity.Init(config=cfg): model = MyModel()` builds `model` without allocating weights.

    Parameters go to the meta device as they are registered; buffers are made where the module makes them,
    with their values. With `include_buffers=True` every tensor created inside is on the meta device,
    buffers included, and `initialize` refuses meta buffers, whose values cannot be recomputed.
    """

    def __init__(
        self, config: InfinityConfig | dict | str | None = None, enabled: bool = True, include_buffers: bool = False
    ) -> None:
        self.config = load_config(config) if config is not None else None  # validated early, at the edge
        self.enabled = enabled
        self.include_buffers = include_buffers
        self._context: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> Init:
        if self.enabled:
            self._context = torch.device("meta") if self.include_buffers else parameters_on_meta()
            self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(*exc)
