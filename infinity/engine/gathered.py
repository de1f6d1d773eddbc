"""Full weights outside forward: `GatheredParameters` and the engine's `full_state_dict`."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from torch import nn

from infinity.engine.state_io import iter_full_state
from infinity.partition import FlatParam

if TYPE_CHECKING:
    from infinity.engine.engine import InfinityEngine


@torch.no_grad()
def full_state_dict(engine: InfinityEngine) -> dict[str, torch.Tensor]:
    """Full fp32 weights on CPU keyed like the unwrapped model's state_dict (every name of a tied weight)."""
    values = dict(iter_full_state(engine))
    return OrderedDict((key, values[key]) for key in engine.module.state_dict(keep_vars=True))


class GatheredParameters:
    """Full weights of sharded parameters inside the block; written back to the shards on exit when
    `modifier_rank` is given (that rank's values are broadcast to all first)."""

    def __init__(self, params: nn.Parameter | list[nn.Parameter], modifier_rank: int | None = None) -> None:
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.flats: list[FlatParam] = []
        for p in params:
            flat = getattr(p, "_infinity_flat", None)
            if flat is not None and flat not in self.flats:
                self.flats.append(flat)
        self.modifier_rank = modifier_rank
        self._was_gathered: list[bool] = []
        self._saved: dict[FlatParam, torch.Tensor] = {}

    def __enter__(self) -> None:
        for flat in self.flats:
            engine = flat.params[0]._infinity_owner
            self._was_gathered.append(flat.gathered)
            if flat.resident:  # the weights are the shard itself: keep them to restore unless modified
                self._saved[flat] = flat.full.clone()
            if not flat.gathered:
                flat.gather_from(engine.placement.read(flat).to(engine.device))

    @torch.no_grad()
    def __exit__(self, *exc) -> None:
        for flat, was_gathered in zip(self.flats, self._was_gathered, strict=True):
            engine = flat.params[0]._infinity_owner
            if self.modifier_rank is not None and exc[0] is None:
                engine.comm.broadcast(flat.full, self.modifier_rank, f"modified weights of {flat.name}")
                start, end = flat.shard_range
                new_shard = flat.full[start:end]
                engine.placement.assign(flat, new_shard)
                if flat in engine.optimizer.shard_states:
                    values = engine.optimizer.read_state(flat)
                    values["master"] = new_shard.float().cpu()
                    engine.optimizer.load_state(flat, values)
            elif flat in self._saved:  # changes without a modifier (or cut short by an error) are discarded
                flat.full.copy_(self._saved[flat])
            elif was_gathered:  # ... also on always-gathered weights
                flat.gather_from(engine.placement.read(flat).to(engine.device))
            if not was_gathered:
                flat.release()
        self._saved.clear()
