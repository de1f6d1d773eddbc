"""Rank functions for the fault-injection tests: train through the public API, damage the swap file, go on.

Only `infinity.initialize`, `engine(x, y)`, `engine.backward`, `engine.step` and `engine.close` are used;
the damage is done to the file on disk, as a user or another process would.
"""

from __future__ import annotations

import os
import random
import shutil

import torch
from out_of_core_cases import gpt_config, nvme_config
from toy_models import batches

import infinity
from infinity.models.gpt import GPT
from infinity.storage import SwapFileError

FAULTS = ("truncate", "overwrite", "bitflip", "delete", "replace")
MiB = 1 << 20
# Four blocks of the tiny GPT: ~0.93 MB of training state, every shard on NVMe. Budgets just above the
# largest block's need, so every step streams every shard from the swap file.
N_LAYER = 4
BUDGET_BYTES = 400_000


class FaultCaught(Exception):
    """The run stopped with a swap-file error: after how many steps past the damage, and what it said."""

    def __init__(self, steps_after_fault: int, kind: str, message: str, swap_left: bool) -> None:
        super().__init__(steps_after_fault, kind, message, swap_left)
        self.steps_after_fault = steps_after_fault
        self.kind = kind
        self.message = message
        self.swap_left = swap_left  # after engine.close()


def damage(swap: str, fault: str) -> None:
    """Do to `swap` what `fault` names, from outside the process's view of it."""
    rng = random.Random(0)
    if fault == "truncate":
        os.truncate(swap, 4096)
    elif fault == "overwrite":
        with open(swap, "r+b") as fh:
            fh.seek(4096)  # past the header: the shards themselves
            fh.write(rng.randbytes(4 * MiB))
    elif fault == "bitflip":
        size = os.path.getsize(swap)  # the file is sized to the run's slots: flip within them
        with open(swap, "r+b") as fh:  # one bit in every 32 KiB of the shards' region: one or more per shard
            for offset in range(4096, min(size, 4096 + 2 * MiB), 32 * 1024):
                fh.seek(offset)
                byte = fh.read(1)[0]
                fh.seek(offset)
                fh.write(bytes([byte ^ (1 << rng.randrange(8))]))
    elif fault == "delete":
        os.unlink(swap)
    elif fault == "replace":
        shutil.copyfile(swap, swap + ".copy")
        os.replace(swap + ".copy", swap)
    else:
        raise ValueError(f"unknown fault {fault!r}")


def train_with_fault(nvme_path: str, fault: str, fault_rank: int, steps_before: int = 2, steps_after: int = 3):
    """Train `steps_before` steps, damage rank `fault_rank`'s swap file, train on; FaultCaught when it stops."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = nvme_config(nvme_path, host_budget=BUDGET_BYTES, device_budget=BUDGET_BYTES)
    torch.manual_seed(0)
    engine, _, _, _ = infinity.initialize(model=GPT(gpt_config(N_LAYER)), config=cfg)
    data = batches("gpt", 2, rank=rank, world_size=world)
    swap = os.path.join(nvme_path, f"infinity-rank{rank}.swap")
    losses = []

    def step() -> None:
        x, y = next(data)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    for _ in range(steps_before):
        step()
    dist.barrier()
    if rank == fault_rank:
        damage(swap, fault)
    dist.barrier()
    for done in range(steps_after):
        try:
            step()
        except SwapFileError as exc:
            engine.close()
            raise FaultCaught(done, type(exc).__name__, str(exc), os.path.exists(swap)) from None
    engine.close()
    return {"losses": losses}
