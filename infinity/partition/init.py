"""`infinity.Init`: build a model too large for memory without ever holding it.

Inside the context, parameters are created on the meta device (shapes, no storage). `initialize`
then materializes the model block by block with its own initializers, shards and offloads each
block before the next exists, so the full model never lives in host or device memory.
"""

from __future__ import annotations

import torch

from infinity.config import InfinityConfig, load_config


class Init:
    """`with infinity.Init(config=cfg): model = MyModel()` builds `model` without allocating weights.

    Buffers are created on the meta device too unless a module creates them on an explicit device;
    `initialize` refuses meta buffers, whose values cannot be recomputed.
    """

    def __init__(self, config: InfinityConfig | dict | str | None = None, enabled: bool = True) -> None:
        self.config = load_config(config) if config is not None else None  # validated early, at the edge
        self.enabled = enabled
        self._device = torch.device("meta")

    def __enter__(self) -> Init:
        if self.enabled:
            self._device.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._device.__exit__(*exc)
