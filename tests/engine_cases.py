"""Models, data and the per-rank training function shared by the engine tests.

`train_infinity` runs on each rank (inside `run_distributed`); `reference_run` trains the same model
on the same global batches with plain PyTorch (`reference.train_reference`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from reference import train_reference
from torch import nn

import infinity
from infinity.data.corpus import ByteBatches, load_corpus
from infinity.models.gpt import GPT, gpt_preset
from infinity.models.mlp import MLP

SEQ = 16
LR = 1e-2
WEIGHT_DECAY = 0.1


def make_model(kind: str, seed: int = 0) -> nn.Module:
    """The test models. GPTs use bias=False: the attention key bias has a mathematically zero gradient,
    so Adam turns its rounding noise into full-size updates and no two implementations agree on it."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP(in_features=16, hidden=40, out_features=8, n_layers=3)
    options = {
        "gpt": {},
        "gpt_functional_tie": {"tied_head_functional": True},
        "gpt_checkpointed": {"activation_checkpointing": True},
    }[kind]
    return GPT(gpt_preset("tiny", bias=False, block_size=SEQ, **options))


def batches(kind: str, micro_bs: int, seed: int = 0, rank: int = 0, world_size: int = 1) -> Iterator:
    """Deterministic micro-batches; rank r's rows of global batch s are rows [r*b, (r+1)*b)."""
    if kind.startswith("gpt"):
        yield from ByteBatches(load_corpus(), micro_bs, SEQ, seed=seed, rank=rank, world_size=world_size)
    step = 0
    while True:
        gen = torch.Generator().manual_seed(seed * 7919 + step)
        x = torch.randn(micro_bs * world_size, 16, generator=gen)
        y = torch.randn(micro_bs * world_size, 8, generator=gen)
        rows = slice(rank * micro_bs, (rank + 1) * micro_bs)
        yield x[rows], y[rows]
        step += 1


def ds_config(
    *,
    kind: str = "gpt",
    micro_bs: int,
    grad_accum: int = 1,
    offload_param: str = "none",
    offload_optimizer: str = "none",
    dtype: str = "fp32",
    clip: float = 1.0,
    extra_zero: dict | None = None,
    nvme_path: str | None = None,
) -> dict:
    block_classes = ["MLPLayer"] if kind == "mlp" else ["Block"]
    cfg = {
        "train_micro_batch_size_per_gpu": micro_bs,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {
            "stage": 3,
            "block_classes": block_classes,
            "stage3_param_persistence_threshold": 64,
            "offload_param": {"device": offload_param, "nvme_path": nvme_path},
            "offload_optimizer": {"device": offload_optimizer, "nvme_path": nvme_path},
            **(extra_zero or {}),
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train_infinity(kind: str, config: dict, steps: int, micro_bs: int, seed: int = 0) -> dict:
    """Train on this rank; return its per-step losses and the full state dict it sees."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    engine, _, _, _ = infinity.initialize(model=make_model(kind, seed), config=config)
    data = batches(kind, micro_bs, seed=seed, rank=rank, world_size=world)
    dtype = engine.compute_dtype
    losses = []
    for _ in range(steps):
        step_loss = 0.0
        for _ in range(engine.gradient_accumulation_steps):
            x, y = next(data)
            if x.is_floating_point():
                x, y = x.to(dtype), y.to(dtype)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / engine.gradient_accumulation_steps
        losses.append(step_loss)
    result = {"losses": losses, "state": engine.full_state_dict(), "skipped": engine.skipped_steps}
    result["stepped_in_backward"] = getattr(engine.optimizer, "stepped_in_backward", 0)
    result["bytes_moved"] = engine.bytes_moved
    result["trainable_shard_elems"] = sum(f.shard_numel for f in engine.flats if f.requires_grad)
    engine.close()
    return result


def reference_run(
    kind: str, steps: int, global_bs: int, grad_accum: int, clip: float, dtype: torch.dtype, seed=0, device="cpu"
):
    return train_reference(
        lambda: make_model(kind, seed),
        batches(kind, global_bs, seed=seed),
        steps,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        grad_clip=clip,
        grad_accum=grad_accum,
        dtype=dtype,
        device=device,
    )


def mean_over_ranks(results: list[dict]) -> list[float]:
    """The global-batch loss of each step: ranks see equal micro-batch sizes, so the mean of theirs."""
    return [sum(r["losses"][i] for r in results) / len(results) for i in range(len(results[0]["losses"]))]
