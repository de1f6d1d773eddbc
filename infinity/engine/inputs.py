"""The forward's inputs on the compute device: what `InfinityEngine.forward` moves, and what it refuses.

Every tensor found in the positional and keyword arguments, nested in lists, tuples (named ones too)
and dicts, that lives in CPU memory is copied to the compute device (its dtype unchanged); tensors
already there pass as they are, and so does anything that is not a tensor. A tensor on another device
(another GPU, the meta device) is an error naming where it was found: moving it silently would hide a
bug in the caller's placement.
"""

from __future__ import annotations

from typing import Any

import torch


def move_inputs(args: tuple, kwargs: dict[str, Any], device: torch.device) -> tuple[tuple, dict[str, Any]]:
    """(`args`, `kwargs`) with their CPU tensors copied to `device`; see the module docstring."""
    moved_args = tuple(_move(a, device, f"args[{i}]") for i, a in enumerate(args))
    return moved_args, {k: _move(v, device, f"kwargs[{k!r}]") for k, v in kwargs.items()}


def _move(value: Any, device: torch.device, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        if value.device.type != "cpu":
            raise ValueError(
                f"forward input {where} is on {value.device}, but this rank computes on {device}; the engine moves "
                f"CPU tensors only: pass it in CPU memory or on {device}"
            )
        return value.to(device)
    if isinstance(value, dict):
        moved = {k: _move(v, device, f"{where}[{k!r}]") for k, v in value.items()}
        try:
            return type(value)(moved)
        except TypeError:  # a dict subclass that cannot be built from a dict (defaultdict)
            return moved
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_move(v, device, f"{where}.{name}") for name, v in zip(value._fields, value, strict=True)))
    if isinstance(value, (list, tuple)):
        return type(value)(_move(v, device, f"{where}[{i}]") for i, v in enumerate(value))
    return value
