"""Parameters without storage: built on the meta device, and remade as real tensors of the same kind.

A model too large for memory is built with its parameters on the meta device (`parameters_on_meta`) and
materialized block by block later. Each time a parameter is remade, `parameter_like` keeps what the model's
code may have put on it: its class (a `nn.Parameter` subclass) and its Python attributes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def parameter_like(param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter holding `data` with `param`'s class, `requires_grad` and attributes (shared, not copied), but
    for the mark that says its values are set (`_is_hf_initialized`).

    The class is rebuilt as `torch` rebuilds it for `copy.deepcopy`: `type(param)(data, requires_grad)`.
    """
    cls = type(param)
    try:
        new = cls(data, param.requires_grad)
    except TypeError as exc:
        raise TypeError(
            f"cannot remake a parameter of class {cls.__qualname__}: its constructor must accept "
            f"(data, requires_grad), as nn.Parameter's does and copy.deepcopy expects ({exc})"
        ) from exc
    new.__dict__.update(param.__dict__)
    # transformers marks a tensor whose values are loaded or set, and its initializers then skip it; a remade
    # parameter has new storage, so its values are not those any more and the model's initializer must run
    new.__dict__.pop("_is_hf_initialized", None)
    return new


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside, every parameter a module registers is moved to the meta device (its `torch.empty` storage is
    dropped untouched); buffers stay where they were made, with their values."""
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = parameter_like(param, param.detach().to("meta"))
        original(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original
