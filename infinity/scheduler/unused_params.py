"""`ignore_unused_parameters: false`: every trainable parameter must get a gradient in each optimizer step.

DeepSpeed stops with an error when a trainable parameter took no part in the loss and the option is false
(true, the default, lets such parameters through: the step leaves them as they are, `optim.param_steps`).
`UnusedParameterCheck` counts gradient arrivals per parameter with its own hooks; `check()` at the step
boundary raises on every rank together (the count of unused parameters is summed over ranks first, so no
rank goes on into a collective the others left), naming this rank's unused parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from infinity.comm import CommGroup

_SHOWN = 10


class UnusedParameterCheck:
    def __init__(self, model: nn.Module, comm: CommGroup, device: torch.device) -> None:
        self.comm = comm
        self.device = device
        self._names: dict[int, str] = {}
        self._used: set[int] = set()
        self._handles = []
        for name, p in model.named_parameters():  # a tied weight once, under its first name
            if p.requires_grad:
                self._names[id(p)] = name
                self._handles.append(p.register_post_accumulate_grad_hook(self._arrived))

    def _arrived(self, param) -> None:
        self._used.add(id(param))

    def check(self) -> None:
        """At an optimizer step: raise if a trainable parameter got no gradient since the last check."""
        unused = [name for key, name in self._names.items() if key not in self._used]
        self._used.clear()
        count = torch.tensor([len(unused)], dtype=torch.int64, device=self.device)
        total = self.comm.all_reduce(count, "unused parameter count")
        if int(total.item()) == 0:
            return
        shown = ", ".join(unused[:_SHOWN]) + (f" and {len(unused) - _SHOWN} more" if len(unused) > _SHOWN else "")
        raise RuntimeError(
            f"rank {self.comm.rank}: {len(unused)} trainable parameter(s) received no gradient in this step"
            + (f": {shown}" if unused else " here (unused on another rank)")
            + "; they took no part in the loss. Set 'zero_optimization.ignore_unused_parameters' to true to "
            "train without them, or make every trainable parameter (and every forward output) count in the loss"
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
