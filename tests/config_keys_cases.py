"""Rank functions and models for the DeepSpeed keys of issue 15 (test_config_keys.py)."""

from __future__ import annotations

import contextlib
import io
import random
from typing import Any

import numpy as np
import torch
from harness import Reference, config, rank_and_world, reference_train, train_steps
from torch import nn
from toy_models import batches, make_model

import infinity
from infinity.models.mlp import MLP
from infinity.shards import ShardKind

PROBE_WIDTH = 3000  # over two 1024-aligned shards, so each rank holds part of the gradient


class ProbeLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(PROBE_WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class GradientProbe(nn.Module):
    """forward(x, c) = sum(x * weight * c): with x = ones(1, width) the weight's gradient is exactly `c`, so a
    test chooses every rank's gradient, up to values near the fp32 limit."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ProbeLayer()])

    def forward(self, x: torch.Tensor, c: torch.Tensor):
        return None, (self.layers[0](x) * c).sum()


def probe_gradients(rank: int, huge: bool) -> torch.Tensor:
    """Rank `rank`'s gradient: random normal values, or (huge) both ranks 0.75 of the fp32 maximum."""
    if huge:
        return torch.full((PROBE_WIDTH,), 0.75 * torch.finfo(torch.float32).max)
    return torch.randn(PROBE_WIDTH, generator=torch.Generator().manual_seed(100 + rank))


def reduced_probe_gradient(extra: dict[str, Any], huge: bool) -> dict[str, torch.Tensor]:
    """One backward of the probe on this rank with its chosen gradient; this rank's reduced gradient shard."""
    rank, _ = rank_and_world()
    cfg = config(micro_bs=1, clip=0.0, block_classes=("ProbeLayer",), extra=extra)
    engine = infinity.initialize(model=GradientProbe(), config=cfg)[0]
    _, loss = engine(torch.ones(1, PROBE_WIDTH), probe_gradients(rank, huge))
    engine.backward(loss)
    (flat,) = engine.shards.records
    start, end = flat.shard_range
    shard = engine.shards.read(flat, ShardKind.GRAD)
    engine.close()
    assert start < flat.numel
    return {"shard": shard, "start": start, "end": min(end, flat.numel)}


class MLPWithUnused(MLP):
    """The feature tests' MLP with one more layer that forward never calls."""

    def __init__(self) -> None:
        super().__init__(in_features=16, hidden=24, out_features=8, n_layers=3)
        self.unused = nn.Linear(24, 24)


def train_with_unused(ignore_unused: bool, steps: int) -> dict[str, Any]:
    """Train MLPWithUnused; the losses and state, or the error this rank raised."""
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model = MLPWithUnused()
    cfg = config("mlp", extra_zero={"ignore_unused_parameters": ignore_unused})
    engine = infinity.initialize(model=model, config=cfg)[0]
    data = batches("mlp", 2, rank=rank, world_size=world)
    try:
        losses = train_steps(engine, data, steps)
    except RuntimeError as exc:
        return {"error": str(exc)}
    finally:
        state = engine.full_state_dict()
        engine.close()
    return {"losses": losses, "state": state}


def _mlp_with_unused() -> MLPWithUnused:
    torch.manual_seed(0)
    return MLPWithUnused()


def plain_with_unused(steps: int, global_bs: int) -> Reference:
    """Plain PyTorch: the unused layer has no gradient and AdamW leaves it alone."""
    return reference_train(_mlp_with_unused, batches("mlp", global_bs), steps)


def draws_after_initialize(seed: int | None) -> dict[str, Any]:
    """Initialize with `seed` (None: unset); what each generator draws next, and the generators' states before."""
    model = make_model("mlp")  # seeds torch itself: the states are taken after it
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    extra = {} if seed is None else {"seed": seed}
    engine = infinity.initialize(model=model, config=config("mlp", extra=extra))[0]
    draws = {"random": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(3)}
    engine.close()
    return {"draws": draws, "before": before}


def meta_mlp_initial_weights(seed: int) -> dict[str, torch.Tensor]:
    """An MLP built on the meta device and materialized by initialize under `seed`: its initial weights."""
    with infinity.Init():
        model = MLP(in_features=16, hidden=24, out_features=8, n_layers=3)
    engine = infinity.initialize(model=model, config=config("mlp", extra={"seed": seed}))[0]
    state = engine.full_state_dict()
    engine.close()
    return state


def initialize_and_capture(config: dict) -> dict[str, Any]:
    """Initialize and train one step on this rank; what it printed (stdout, stderr)."""
    rank, world = rank_and_world()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        engine = infinity.initialize(model=make_model("mlp"), config=config)[0]
        x, y = next(batches("mlp", 2, rank=rank, world_size=world))
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.close()
    return {"stdout": out.getvalue(), "stderr": err.getvalue()}


def save_16bit(tmp: str, enabled: bool, dtype: str, stage: int = 3) -> dict[str, Any]:
    """Train two steps in `dtype` at `stage`, save a checkpoint and a 16-bit file; the engine's full weights
    and what save_16bit_model returned."""
    rank, world = rank_and_world()
    extra: dict[str, Any] = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
    cfg = config(
        "mlp",
        offload_param="cpu" if stage == 3 else "none",
        offload_optimizer="cpu",
        extra=extra,
        extra_zero={"stage3_gather_16bit_weights_on_model_save": enabled, "stage": stage},
    )
    engine = infinity.initialize(model=make_model("mlp"), config=cfg)[0]
    data = batches("mlp", 2, rank=rank, world_size=world, dtype=engine.compute_dtype)
    for _ in range(2):
        x, y = next(data)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        folder = engine.save_checkpoint(f"{tmp}/ck")
        saved = engine.save_16bit_model(f"{tmp}/out", "model.safetensors")
    state = engine.full_state_dict()
    engine.close()
    return {"state": state, "folder": folder, "saved": saved, "stderr": err.getvalue()}


def timed_steps(steps: int, wall_clock: bool) -> dict[str, Any]:
    """Train with steps_per_print 2 and wall_clock_breakdown as given; output, the last split, seconds spent."""
    import time

    cfg = config("mlp", extra={"wall_clock_breakdown": wall_clock, "steps_per_print": 2})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        engine = infinity.initialize(model=make_model("mlp"), config=cfg)[0]
        data = batches("mlp", 2)
        start = time.perf_counter()
        for _ in range(steps):
            x, y = next(data)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        elapsed = time.perf_counter() - start
        last = dict(engine.wall_clock.last_s)
        lr, norm = engine.get_lr(), engine.get_global_grad_norm()
        engine.close()
    return {"stdout": out.getvalue(), "last": last, "elapsed": elapsed, "lr": lr, "norm": norm}



