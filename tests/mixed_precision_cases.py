"""The rank function of the mixed-precision tests: the tiny GPT trained in bf16 or fp16, optionally with one
deliberate mistake patched into the engine (`MUTATIONS`), recording what the reference records."""

from __future__ import annotations

from typing import Any

import torch
from harness import config, rank_and_world
from toy_models import batches, make_model

import infinity
from infinity.optim.sharded_adam import ShardedAdam

# Chosen so that every mistake below moves the result far more than mixed precision's own rounding does:
# a clip well under the gradient norm (clipping on every step, by a varying factor), an eps near the clipped
# gradients' size (so Adam is no longer blind to a constant gradient scale), and a weight decay whose pull
# over the run is many times the rounding noise.
LR = 1e-2
BETAS = (0.9, 0.999)
EPS = 1e-4
WEIGHT_DECAY = 0.5
CLIP = 0.1
FP16 = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 3, "hysteresis": 1}

MUTATIONS = ("no_weight_decay", "no_clipping", "beta2_0.99", "grads_left_scaled", "step_skipped")


def mp_config(dtype: str, micro_bs: int, grad_accum: int, offload: str, nvme_path: str | None = None) -> dict:
    optimizer = {
        "type": "AdamW",
        "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
    }
    precision = {"bf16": {"enabled": True}} if dtype == "bf16" else {"fp16": dict(FP16)}
    return config(
        "gpt",
        micro_bs=micro_bs,
        grad_accum=grad_accum,
        clip=CLIP,
        persistence=64,
        offload_param=offload,
        offload_optimizer=offload,
        nvme_path=nvme_path,
        extra={"optimizer": optimizer, **precision},
    )


def _mutate(engine, mutation: str | None, monkeypatch_clip) -> None:
    """Patch one mistake into this engine."""
    if mutation is None:
        return
    groups = engine.optimizer.param_groups
    if mutation == "no_weight_decay":
        for g in groups:
            g["weight_decay"] = 0.0
    elif mutation == "beta2_0.99":
        for g in groups:
            g["betas"] = (g["betas"][0], 0.99)
    elif mutation == "no_clipping":
        monkeypatch_clip()
    elif mutation in ("grads_left_scaled", "step_skipped"):
        original = engine.optimizer.step_shards
        calls = [0]

        def step_shards(grad_scale: float = 1.0, **kwargs):
            calls[0] += 1
            if mutation == "step_skipped" and calls[0] == 2:
                return None  # the second applied step updates nothing
            factor = 2.0**16 if mutation == "grads_left_scaled" else 1.0
            return original(grad_scale=grad_scale * factor, **kwargs)

        engine.optimizer.step_shards = step_shards
    else:
        raise KeyError(mutation)


def train_mixed(dtype: str, steps: int, micro_bs: int, grad_accum: int, offload: str, mutation: str | None,
                nvme_path: str | None = None) -> dict[str, Any]:
    rank, world = rank_and_world()
    cfg = mp_config(dtype, micro_bs, grad_accum, offload, nvme_path)
    engine = infinity.initialize(model=make_model("gpt"), config=cfg)[0]

    def no_clip() -> None:
        ShardedAdam.clip_coefficient = staticmethod(lambda norm, max_norm: 1.0)

    _mutate(engine, mutation, no_clip)
    data = batches("gpt", micro_bs, rank=rank, world_size=world)
    losses, scales, norms, skipped = [], [], [], []
    for _ in range(steps):
        scales.append(engine.loss_scaler.scale)
        skipped_before = engine.skipped_steps
        step_loss = 0.0
        for _ in range(grad_accum):
            x, y = next(data)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / grad_accum
        losses.append(step_loss)
        norms.append(engine.last_grad_norm)
        skipped.append(engine.skipped_steps > skipped_before)
    result = {"losses": losses, "scales": scales, "norms": norms, "skipped": skipped, "state": engine.full_state_dict()}
    result["moments"] = _moments(engine)
    engine.close()
    return result


def _moments(engine) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """AdamW's (m, v) of every trainable parameter, by its first name, gathered from every rank's shards."""
    out: dict[str, list[torch.Tensor]] = {}
    for flat in engine.shards.records:
        moments = engine.shards.read_moments(flat)  # fp32 moments: float32 views of the packed slot
        for name in ("exp_avg", "exp_avg_sq"):
            shard = moments[name]
            full = torch.empty(flat.padded_numel, dtype=torch.float32)
            engine.comm.all_gather(full, shard, f"{name} of {flat.name}")
            for fqn, value in flat.unflatten(full).items():
                out.setdefault(fqn, []).append(value.clone())
    return {name: (m, v) for name, (m, v) in out.items()}
