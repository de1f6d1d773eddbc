"""This rank's device and process group: the device is bound first, then the group joins (or is created):
NCCL on CUDA, Gloo on CPU."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def bind_compute_device() -> torch.device:
    """This rank's compute device, made the current CUDA device before any process group exists
    (`device_index` says which); the CPU without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    current = torch.cuda.current_device()
    index = device_index(current, os.environ.get("LOCAL_RANK"), torch.cuda.device_count())
    if index != current:
        torch.cuda.set_device(index)
    return torch.device("cuda", index)


def device_index(current: int, local_rank: str | None, device_count: int) -> int:
    """The GPU a rank binds: one the user already made current (any but the default 0) stays; else
    LOCAL_RANK's (torchrun sets it; 0 without a launcher), or 0 where each process sees one GPU."""
    if current != 0 or local_rank is None:
        return current
    try:
        index = int(local_rank)
    except ValueError:
        raise RuntimeError(f"LOCAL_RANK is {local_rank!r}, not a number: start the job with torchrun") from None
    if index < device_count:
        return index
    if device_count == 1:
        return 0  # each process was given its own GPU (CUDA_VISIBLE_DEVICES per rank)
    raise RuntimeError(
        f"LOCAL_RANK={index} but this process sees {device_count} GPUs: start at most {device_count} processes "
        "per node (torchrun --nproc_per_node), or give each its own GPU with CUDA_VISIBLE_DEVICES"
    )


_created_here = False  # the default group was created by init_distributed


def init_distributed(device: torch.device, timeout_s: float) -> tuple[int, int]:
    """Return (rank, world_size), creating the default group from torchrun's env when needed.

    A single process started without a launcher runs with world size 1 and no process group.
    Call `bind_compute_device` first: NCCL binds each rank to the current device.
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
    global _created_here
    _created_here = True
    return dist.get_rank(), dist.get_world_size()


def group_given_by_caller() -> bool:
    """Whether the default process group exists and was created by the caller, not by `init_distributed` (so
    with the caller's timeout)."""
    return dist.is_available() and dist.is_initialized() and not _created_here


def comm_device(compute: torch.device, group: dist.ProcessGroup | None) -> torch.device:
    """The device whose tensors `group`'s collectives take: the compute device where the backend serves
    it (NCCL for CUDA, Gloo for the CPU); with no group (one rank) collectives are local copies there."""
    if group is None:
        return compute
    backend = str(dist.get_backend(group))
    wanted = "nccl" if compute.type == "cuda" else "gloo"
    if wanted not in backend:
        raise RuntimeError(
            f"the process group's backend is {backend!r} but this rank computes on {compute}, whose collectives "
            f"need {wanted!r}: create the group with backend={wanted!r}, or let infinity create it from "
            "torchrun's environment"
        )
    return compute
