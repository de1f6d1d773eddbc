"""Which parameters of each flat got a gradient this step: the step skips the others (`optim.param_steps`).

A mixin of `ShardStore` (its records and comm). Each micro-batch notes this rank's presence (`note`); a
parameter counts where any rank's gradient had it, in any micro-batch, as one process with the whole batch
would see it. With several ranks the ranks agree once per step, before it (`agree_grad_presence`: one
max all-reduce over every flat not agreed yet), or, where a flat steps as its gradient arrives in backward,
with that flat's block's reduction (`agreed_grad_presence`: a tensor on the device, built and reduced there
without a host copy, read when the flat's gradient arrives, where the gradient crossing has waited for the
device anyway). `zero_grad` forgets it all.
"""

from __future__ import annotations

import torch

from infinity.partition.flat_param import FlatParam

Presence = tuple[bool, ...] | None  # per parameter, in slot order: got a gradient (None: all did)


def ones_where(present: list[bool], device: torch.device) -> torch.Tensor:
    """1.0 where `present`, else 0.0, on `device`, with no copy from the host (no wait for the device's queue)."""
    out = torch.zeros(len(present), dtype=torch.float32, device=device)
    start = None
    for i, got in enumerate([*present, False]):
        if got and start is None:
            start = i
        elif not got and start is not None:
            out[start:i].fill_(1.0)
            start = None
    return out


class GradPresence:
    """`ShardStore`'s presence verbs; see the module docstring."""

    def note_grad_presence(self, flat: FlatParam, present: tuple[bool, ...]) -> None:
        """Which of `flat`'s parameters got a gradient in this micro-batch on this rank."""
        record = self.records[flat]
        if record.used is not None:
            present = tuple(a or b for a, b in zip(self.grad_presence(flat), present, strict=True))
        record.used = present
        record.used_agreed = self.comm.world_size == 1

    def agreed_grad_presence(self, flat: FlatParam, present: torch.Tensor) -> None:
        """The ranks' presence for `flat` (1 where some rank had the gradient), agreed with its block's reduction."""
        record = self.records[flat]
        record.used, record.used_agreed = present, True

    def agree_grad_presence(self) -> None:
        """Before a step: the ranks agree on the presence of every flat not agreed yet, in one all-reduce (the
        same flats on every rank: the records' order, and the blocks whose reductions agreed theirs)."""
        pending = [(f, r) for f, r in self.records.items() if not r.used_agreed]
        if self.comm.world_size == 1 or not pending:
            return
        mine = [v for f, r in pending for v in (self.grad_presence(f) or (True,) * len(f.slots))]
        both = torch.tensor(mine, dtype=torch.float32).to(self.comm.device)
        agreed = self.comm.all_reduce(both, "which parameters got gradients", op="max").tolist()
        start = 0
        for flat, record in pending:
            n = len(flat.slots)
            record.used, record.used_agreed = tuple(v > 0 for v in agreed[start : start + n]), True
            start += n

    def grad_presence(self, flat: FlatParam) -> Presence:
        """Which of `flat`'s parameters got a gradient this step (None: all, or not known)."""
        record = self.records[flat]
        if isinstance(record.used, torch.Tensor):
            record.used = tuple(v > 0 for v in record.used.tolist())
        return record.used

    def forget_grad_presence(self) -> None:
        for record in self.records.values():
            record.used, record.used_agreed = None, False
