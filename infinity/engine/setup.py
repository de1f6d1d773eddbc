"""The engine's wiring steps that are not the engine: the compute device, checks on the model, process
settings, the tier store, seeding and buffers. Each takes what it needs as arguments."""

from __future__ import annotations

import os
import random

import numpy as np
import torch
from torch import nn

from infinity.comm import bind_compute_device
from infinity.config import InfinityConfig
from infinity.engine.host_memory import limit_freed_memory
from infinity.engine.memory_plan import MemoryPlan
from infinity.partition.materialize import check_materializable
from infinity.shards import MallocTuning, Placement
from infinity.shards.registry import owner_of
from infinity.storage import Recorder, TierStore, check_free_space, swap_file_bytes


def compute_device() -> torch.device:
    """This rank's compute device, bound as the current CUDA device (see `bind_compute_device`)."""
    return bind_compute_device()


def hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def check_model(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if owner_of(p) is not None:
            raise ValueError(
                f"this model is already wrapped by an infinity engine (its parameter '{name}' is sharded); pass "
                "the original model only once, or close() the other engine first"
            )
    if any(p.is_meta for p in model.parameters()):
        check_materializable(model)


def apply_process_settings(placement: Placement) -> None:
    """Process-wide settings the placement calls for: CPU float hygiene, malloc's freed memory."""
    if placement.compute_device.type == "cpu":
        torch.set_flush_denormal(True)  # decaying weights in denormals slow CPU steps several-fold
    if placement.malloc is not MallocTuning.NONE:
        limit_freed_memory(return_to_os=placement.malloc is MallocTuning.RETURN_TO_OS)  # see host_memory


def open_tiers(
    cfg: InfinityConfig, memory: MemoryPlan, nvme_bytes: int, rank: int, device: torch.device, recorder: Recorder
) -> TierStore:
    """The tier store, its swap file sized to this rank's NVMe slots after checking that the disk holds
    every local rank's (they share the nvme_path)."""
    z = cfg.zero_optimization
    sections = (z.offload_param, z.offload_optimizer)
    path = next((s.nvme_path for s in sections if s.device == "nvme" and s.nvme_path), None)
    if path is not None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        check_free_space(path, local_ranks * swap_file_bytes(nvme_bytes), f"{local_ranks} rank(s)' swap files")
    return TierStore.from_config(
        z.offload_param,
        z.offload_optimizer,
        cfg.aio,
        memory.budgets,
        rank=rank,
        device=device,
        recorder=recorder,
        expected_nvme_bytes=nvme_bytes,
    )


def seed_everything(seed: int) -> None:
    """The config's `seed`: Python's, numpy's and torch's generators (every device's) on this rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = buf.to(device)
