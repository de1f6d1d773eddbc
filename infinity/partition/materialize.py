"""Giving meta-device parameters real storage, module by module, with the model's own initializers.

A model built on the meta device (or under `infinity.Init`) has shapes but no values. The engine
materializes one block's modules at a time, just before sharding them, so the whole model never
exists in memory. Each module's own parameters are initialized by the first of: the root model's
`init_module_weights(module)`, its `_init_weights(module)` (the Hugging Face / nanoGPT convention),
or the module's `reset_parameters()`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from infinity.models.meta import parameter_like


def _initializer(root: nn.Module) -> Callable[[nn.Module], None] | None:
    for name in ("init_module_weights", "_init_weights"):
        fn = getattr(root, name, None)
        if callable(fn):
            return fn
    return None


def check_materializable(root: nn.Module) -> None:
    """Raise if a meta model has a module whose parameters nothing can initialize, or meta buffers."""
    has_root_init = _initializer(root) is not None
    for name, module in root.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.is_meta]
        if own and not has_root_init and not hasattr(module, "reset_parameters"):
            raise ValueError(
                f"module '{name}' ({type(module).__name__}) has parameters on the meta device and no way to "
                "initialize them: give it reset_parameters(), or give the model init_module_weights(module) "
                "or _init_weights(module)"
            )
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_meta:
                raise ValueError(
                    f"buffer '{name}.{buf_name}' is on the meta device: its values cannot be recomputed; "
                    "create buffers on a real device (e.g. with torch.device('cpu') inside the module's __init__)"
                )


@torch.no_grad()
def materialize_modules(modules: Iterable[nn.Module], root: nn.Module, device: torch.device) -> int:
    """Materialize and initialize the meta parameters of `modules`; returns how many were materialized.

    Tied parameters are replaced by one new tensor under every name that uses them.
    """
    modules = list(modules)
    init = _initializer(root)
    replaced: dict[int, nn.Parameter] = {}
    touched: list[nn.Module] = []
    owners = {id(m): m for m in root.modules()}
    targets = [m for m in modules if any(p.is_meta for p in m.parameters(recurse=False))]
    if not targets:
        return 0
    for module in owners.values():  # every use of a tied parameter must see the new tensor
        for attr, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in replaced and not any(p is q for t in targets for q in t.parameters(recurse=False)):
                continue
            new = replaced.get(id(p))
            if new is None:
                new = parameter_like(p, torch.empty(p.shape, dtype=p.dtype, device=device))
                replaced[id(p)] = new
            module._parameters[attr] = new
    for module in targets:
        if init is not None:
            init(module)
        else:
            module.reset_parameters()
        touched.append(module)
    if init is not None:
        for parent in _parents_made_whole(modules, targets, replaced):
            init(parent)
    return len(replaced)


def _parents_made_whole(
    modules: Iterable[nn.Module], targets: list[nn.Module], replaced: dict[int, nn.Parameter]
) -> list[nn.Module]:
    """The modules of `modules` without parameters of their own whose every parameter was just materialized,
    descendants before ancestors: a Hugging Face `_init_weights` sets some weights from the parent (GPT-2 scales
    `attn.c_proj` when called on the attention module), after its children, as `model.apply` calls it."""
    fresh = {id(p) for p in replaced.values()}
    own = {id(m) for m in targets}
    parents = []
    for module in modules:
        params = list(module.parameters())
        if id(module) not in own and params and all(id(p) in fresh for p in params):
            parents.append(module)
    return parents[::-1]  # `modules()` lists a parent before its children
