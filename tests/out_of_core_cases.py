"""Rank functions for the out-of-core tests: models built under infinity.Init, NVMe everything, budgets."""

from __future__ import annotations

import json
import sys

import torch
from harness import config, train_steps
from toy_models import SEQ, batches

import infinity
from infinity.models.gpt import GPT, gpt_preset

# Deep and narrow (16 blocks) so the state is many times one block; a gentler lr than the engine matrix
# keeps Adam's amplification of rounding in near-zero gradients inside the shared tolerance.
LR = 1e-3


def nvme_config(nvme_path: str, micro_bs: int = 2, host_budget: int | None = None, device_budget: int | None = None):
    cfg = config(micro_bs=micro_bs, persistence=64, offload_param="nvme", offload_optimizer="nvme", nvme_path=nvme_path)
    cfg["optimizer"]["params"]["lr"] = LR
    cfg["zero_optimization"]["host_budget_bytes"] = host_budget
    cfg["zero_optimization"]["device_budget_bytes"] = device_budget
    return cfg


def gpt_config(n_layer: int = 16, n_embd: int = 32):
    return gpt_preset("tiny", bias=False, block_size=SEQ, n_layer=n_layer, n_embd=n_embd, n_head=4)


def train_from_init(nvme_path: str, steps: int, host_budget: int, device_budget: int, n_layer: int = 16) -> dict:
    """Build under Init, record the initial full weights, train, return losses, weights and store stats."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = nvme_config(nvme_path, host_budget=host_budget, device_budget=device_budget)
    torch.manual_seed(0)  # the initializers run inside initialize(); rank 0's values are broadcast
    with infinity.Init(config=cfg):
        model = GPT(gpt_config(n_layer))
    meta = all(p.is_meta for p in model.parameters())
    engine, _, _, _ = infinity.initialize(model=model, config=cfg)
    initial = dict(engine.iter_full_state())
    losses = train_steps(engine, batches("gpt", 2, rank=rank, world_size=world), steps)
    result = {
        "built_on_meta": meta,
        "initial": initial,
        "losses": losses,
        "state": engine.full_state_dict(),
        "stats": engine.tiers.stats(),
    }
    engine.close()
    return result


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM). Not ru_maxrss: Linux carries that over from the parent
    across fork and exec, so a child of a large pytest process would report the parent's peak."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def peak_rss_run(nvme_path: str, n_layer: int, n_embd: int, host_budget: int, device_budget: int) -> None:
    """Run in a fresh interpreter (see the test): one training step of a model built under Init; print JSON."""
    torch.set_flush_denormal(True)
    cfg = nvme_config(nvme_path, micro_bs=1, host_budget=host_budget, device_budget=device_budget)
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 0  # gathered weights count toward RSS too
    with infinity.Init(config=cfg):
        model = GPT(gpt_preset("tiny", bias=False, block_size=SEQ, n_layer=n_layer, n_embd=n_embd, n_head=8))
    engine, _, _, _ = infinity.initialize(model=model, config=cfg)
    params = sum(f.numel for f in engine.flats)
    x, y = next(batches("gpt", 1))
    _, loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    streamed = 0
    for _, tensor in engine.iter_full_state():
        streamed += tensor.numel()
    out = {
        "params": params,
        "state_bytes": 16 * params,
        "loss": loss.item(),
        "streamed_elems": streamed,
        "stats": engine.tiers.stats(),
        "peak_rss_bytes": peak_rss_bytes(),
    }
    engine.close()
    print(json.dumps(out))


if __name__ == "__main__":
    peak_rss_run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
