"""`DeviceMixCheck`: a dispatch mode that records every op of a training step mixing memories it must not mix.

Two rules, checked on every aten op that runs under it (on the calling thread and on autograd's threads,
which inherit the mode; the tier store's mover thread only copies):
- no op takes tensors from two devices (a host tensor in a device op, or a device tensor in a host op),
  except the copies that move bytes between them and 0-dimensional CPU tensors, which torch passes to a
  device kernel as scalars;
- every tensor that requires grad (a parameter, an activation) that an op takes is on the compute
  device: the only host tensors of a step are the optimizer's state, its gradients and staging buffers.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
TRANSFERS = {
    aten._to_copy.default,
    aten.copy_.default,
    aten._copy_from.default,
    aten._copy_from_and_resize.default,
}


class DeviceMixCheck(TorchDispatchMode):
    """Use as a context manager around training steps; `violations` lists what broke a rule (first 50)."""

    def __init__(self, compute: torch.device) -> None:
        super().__init__()
        self.compute = compute
        self.violations: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func not in TRANSFERS:
            devices = {t.device for t in tensors if not (t.dim() == 0 and t.device.type == "cpu")}
            if len(devices) > 1:
                shapes = [(tuple(t.shape), str(t.device)) for t in tensors]
                self._note(f"{func} mixes devices {sorted(map(str, devices))}: {shapes}")
        for t in tensors:
            if t.requires_grad and t.device != self.compute:
                self._note(f"{func} takes a tensor requiring grad on {t.device}, not {self.compute}: {tuple(t.shape)}")
                break
        return func(*args, **kwargs)

    def _note(self, what: str) -> None:
        if len(self.violations) < 50:
            self.violations.append(what)
