"""Joins (or creates) the torch.distributed process group: NCCL on CUDA, Gloo on CPU."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed(device: torch.device, timeout_s: float) -> tuple[int, int]:
    """Return (rank, world_size), creating the default group from torchrun's env when needed.

    A single process started without a launcher runs with world size 1 and no process group.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(
                f"WORLD_SIZE={world_size} but {var} is not set: start the job with torchrun, "
                "or call torch.distributed.init_process_group before infinity.initialize"
            )
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
