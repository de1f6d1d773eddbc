"""The engine tests' harness: one config builder, one plain-PyTorch reference trainer, one per-rank training
loop and one parity check. The models and data they train are `toy_models`'s, by kind.

    cfg = config("mlp", offload_param="cpu")
    results = run_distributed(train_on_rank, 2, "mlp", cfg, STEPS, MICRO_BS)   # infinity, on each rank
    ref = reference_for("mlp", STEPS, 2 * MICRO_BS)                           # plain PyTorch, one process
    assert_matches_reference(results, ref.losses, ref.state)
    # or, the two last lines in one: assert_matches_plain_pytorch(results, "mlp", STEPS, MICRO_BS)

How batches map: optimizer step s consumes the next `grad_accum` global micro-batches; a global micro-batch
is what all N ranks see in one micro-step, concatenated in rank order (`toy_models.batches`). As in
DeepSpeed, each micro-batch's loss is divided by `grad_accum` before backward, gradients are summed over
the micro-batches, clipped by global norm, then one optimizer step is taken.

Tolerances (`assert_matches_reference`, `assert_weights_close`). fp32: the engine differs from the
reference only in summation order (gradients of two ranks' half-batches summed by reduce-scatter, norms
summed per shard, the fused/native Adam kernels' operation order), so losses agree to rtol 1e-5. Weights
agree to 2e-6 (a few fp32 ulps of weights ~0.02-1 after 4 steps) for all but a few elements: Adam divides
by sqrt(v), so where a gradient is a cancellation of large terms (a rare byte's embedding row) its rounding
difference becomes a difference in the update of up to lr; we allow those on at most 0.5% of a tensor's
elements (or 4, for small tensors such as norms), bounded by 1e-4 (1% of one lr-sized step).
bf16: both sides compute forward and backward in bf16 from identical bf16 weights, but two ranks round
their half-batch gradients separately, and even on one rank a last-bit difference in the fp32 master
(the clipping norm is summed in another order) can flip a bf16 rounding, after which the runs differ by
bf16 ulps (2**-8 relative) amplified by Adam. Losses within 2e-2 relative; 99% of weights within
5e-3 + 2**-6 |w| (a quarter of the 0.02 init scale, or 4 bf16 ulps of the weight), none further than
4e-2 (two lr-sized steps).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from toy_models import batches, make_model

import infinity
from infinity.config import InfinityConfig, load_config, resolve_auto, resolve_batch_sizes
from infinity.shards import Placement, ShardKind, resolve_placement

LR = 1e-2
WEIGHT_DECAY = 0.1

# -- the config ---------------------------------------------------------------------------------------------


def config(
    kind: str = "gpt",
    *,
    micro_bs: int = 2,
    grad_accum: int = 1,
    clip: float = 1.0,
    dtype: str = "fp32",
    offload_param: str = "none",
    offload_optimizer: str = "none",
    nvme_path: str | None = None,
    block_classes: tuple[str, ...] | None = None,
    persistence: int = 0,
    extra: dict | None = None,
    extra_zero: dict | None = None,
) -> dict:
    """A ds_config for the toy model `kind`: ZeRO-3, AdamW(LR, WEIGHT_DECAY), each GPT Block or MLPLayer a
    block (unless `block_classes`), every parameter sharded unless smaller than `persistence` elements.
    `extra` adds top-level keys, `extra_zero` keys of `zero_optimization`."""
    if block_classes is None:
        block_classes = ("Block",) if kind.startswith("gpt") else ("MLPLayer",)
    cfg = {
        "train_micro_batch_size_per_gpu": micro_bs,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {
            "stage": 3,
            "block_classes": list(block_classes),
            "stage3_param_persistence_threshold": persistence,
            "offload_param": {"device": offload_param, "nvme_path": nvme_path},
            "offload_optimizer": {"device": offload_optimizer, "nvme_path": nvme_path},
            **(extra_zero or {}),
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    cfg.update(extra or {})
    return cfg


def resolved(cfg: dict, world_size: int = 1, hidden_size: int = 64) -> InfinityConfig:
    """`cfg` loaded and resolved as the engine does (batch sizes for `world_size`, "auto" values)."""
    return resolve_auto(resolve_batch_sizes(load_config(cfg), world_size), hidden_size)


def placement_of(
    cfg: dict, world_size: int = 1, device: torch.device | None = None, client_optimizer: bool = False
) -> Placement:
    """The placement policy an engine resolves for `cfg` at `world_size` on `device` (default: the CPU)."""
    device = device if device is not None else torch.device("cpu")
    return resolve_placement(resolved(cfg, world_size), device, world_size, client_optimizer)


# -- the plain PyTorch yardstick ------------------------------------------------------------------------------


class Reference(NamedTuple):
    losses: list[float]  # per step: the mean of its micro-batches' unscaled losses
    state: dict[str, torch.Tensor]  # the final fp32 state_dict
    lrs: list[list[float]]  # per step: each param group's lr when it stepped


def config_adamw(
    model: nn.Module,
    lr: float = LR,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = WEIGHT_DECAY,
) -> torch.optim.Optimizer:
    """What the config's optimizer section means: AdamW over the trainable parameters, one group."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)


def reference_train(
    model_fn: Callable[[], nn.Module],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    *,
    lr: float = LR,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = WEIGHT_DECAY,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    clip: float = 1.0,
    grad_accum: int = 1,
    dtype: torch.dtype = torch.float32,
    step_kwargs: Callable[[int], dict] | None = None,
    lr_lambda: Callable[[int], float] | None = None,
    device: torch.device | str = "cpu",
) -> Reference:
    """Train `model_fn()` with plain PyTorch on one process for `steps` optimizer steps.

    The defaults mean what `config()`'s do: AdamW(lr, betas, eps, weight_decay) over the trainable
    parameters (`make_optimizer(model)` replaces it), clipping at global norm `clip` over the parameters
    with gradients (0: none). `model_fn` must build the same initial weights on every call (seed inside
    it); the model's forward is `model(x, y, **step_kwargs(step)) -> (out, loss)`; `lr_lambda` drives a
    LambdaLR. With `dtype=torch.bfloat16` forward and backward run on a bf16 copy while fp32 master weights,
    fp32-accumulated gradients, clipping and the optimizer stay in fp32 (mixed precision as DeepSpeed's bf16).
    Training runs on `device` (the batches are moved there); the returned state is on the CPU.
    """
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"reference_train supports float32 and bfloat16, not {dtype}")
    master = model_fn().float().to(device)
    compute = master if dtype == torch.float32 else model_fn().to(device, dtype)
    if compute is not master:
        compute.load_state_dict(master.state_dict())
    params = list(master.parameters())
    if make_optimizer is None:
        opt = config_adamw(master, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    else:
        opt = make_optimizer(master)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda is not None else None
    it = iter(batches)
    losses, lrs = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for _ in range(grad_accum):
            x, y = (t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in next(it))
            _, loss = compute(x, y, **(step_kwargs(step) if step_kwargs else {}))
            (loss / grad_accum).backward()
            step_loss += loss.item() / grad_accum
            if compute is not master:
                for p, q in zip(params, compute.parameters(), strict=True):
                    if q.grad is not None:
                        p.grad = q.grad.float() if p.grad is None else p.grad + q.grad.float()
                compute.zero_grad(set_to_none=True)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], clip)
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        if sched is not None:
            sched.step()
        if compute is not master:
            with torch.no_grad():
                for p, q in zip(params, compute.parameters(), strict=True):
                    q.copy_(p)
        losses.append(step_loss)
    return Reference(losses, {k: v.detach().to("cpu", copy=True) for k, v in master.state_dict().items()}, lrs)


def reference_for(
    kind: str,
    steps: int,
    global_bs: int,
    *,
    grad_accum: int = 1,
    clip: float = 1.0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> Reference:
    """`reference_train` of the toy model `kind` on its global batches of `global_bs` rows, on `device`."""
    return reference_train(
        lambda: make_model(kind, seed),
        batches(kind, global_bs, seed=seed),
        steps,
        grad_accum=grad_accum,
        clip=clip,
        dtype=dtype,
        device=device,
        **kwargs,
    )


# -- the per-rank training loop -------------------------------------------------------------------------------


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_steps(engine, data, steps: int) -> list[float]:
    """`steps` optimizer steps of one micro-batch each from `data` (an iterator of (x, y)); their losses."""
    losses = []
    for _ in range(steps):
        x, y = next(data)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_on_rank(
    kind: str,
    config: dict,
    steps: int,
    micro_bs: int,
    *,
    seed: int = 0,
    client_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    model_parameters: Callable[[nn.Module], list[dict]] | None = None,
    scheduler_factory: Callable | None = None,
    user_lr_lambda: Callable[[int], float] | None = None,
    step_kwargs: Callable[[int], dict] | None = None,
) -> dict:
    """Train `make_model(kind, seed)` with infinity on this rank (inside `run_distributed`, or alone).

    `client_optimizer(model)` is passed as initialize(optimizer=...), `model_parameters(model)` as
    initialize(model_parameters=...); `scheduler_factory` as lr_scheduler (a callable taking the engine's optimizer);
    `user_lr_lambda` builds a LambdaLR on the returned optimizer that this loop steps after each optimizer
    step, as a user would. Returns plain data: per-step losses, the full state dict, the blocks whose gradients
    were recomputed (a count) and those whose replay's trial failed, the initial state dict, the lrs before
    each step, skipped steps, shards stepped during backward and forward trace invalidations,
    the bytes moved between tiers (`engine.bytes_moved`) and this rank's trainable shard elements.
    """
    rank, world = rank_and_world()
    model = make_model(kind, seed)
    initial = cpu_state(model)
    kwargs: dict[str, Any] = {}
    if client_optimizer is not None:
        kwargs["optimizer"] = client_optimizer(model)
    if model_parameters is not None:
        kwargs["model_parameters"] = model_parameters(model)
    if scheduler_factory is not None:
        kwargs["lr_scheduler"] = scheduler_factory
    engine, optimizer, _, _ = infinity.initialize(model=model, config=config, **kwargs)
    user_sched = torch.optim.lr_scheduler.LambdaLR(optimizer, user_lr_lambda) if user_lr_lambda else None
    data = batches(kind, micro_bs, seed=seed, rank=rank, world_size=world)
    dtype = engine.compute_dtype
    losses, lrs = [], []
    for step in range(steps):
        step_loss = 0.0
        lrs.append(engine.get_lr())
        for _ in range(engine.gradient_accumulation_steps):
            x, y = next(data)
            if x.is_floating_point():
                x, y = x.to(dtype), y.to(dtype)
            _, loss = engine(x, y, **(step_kwargs(step) if step_kwargs else {}))
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / engine.gradient_accumulation_steps
        if user_sched is not None:
            user_sched.step()
        losses.append(step_loss)
    result = {
        "losses": losses,
        "state": engine.full_state_dict(),  # (settles a deferred step: its gradient replays run here)
        "replayed": engine.grad_replay.replayed_blocks if engine.grad_replay is not None else 0,
        "replay_rejected": dict(engine.grad_replay.rejected) if engine.grad_replay is not None else {},
        "initial": initial,
        "lrs": lrs,
        "skipped": engine.skipped_steps,
        "stepped_in_backward": engine.optimizer.stepped_in_backward,
        "stepped_when_needed": engine.optimizer.stepped_when_needed,
        "forward_invalidations": engine.scheduler.forward_trace.invalidations,
        "bytes_moved": engine.bytes_moved,
        "trainable_shard_elems": sum(f.shard_numel for f in engine.flats if f.requires_grad),
        "grad_slot_bytes_per_elem": _nvme_grad_bytes_per_elem(engine),
    }
    engine.close()
    return result


def _nvme_grad_bytes_per_elem(engine) -> int | None:
    """Bytes per element of the gradient slots on NVMe (None: no gradient waits there)."""
    store = engine.shards
    sizes = {
        store.read(f, ShardKind.GRAD).element_size()
        for f in engine.flats
        if f.requires_grad and store.key(f, ShardKind.GRAD) in store.tiers
        and store.tiers.location(store.key(f, ShardKind.GRAD)) is not None
    }
    assert len(sizes) <= 1, sizes
    return sizes.pop() if sizes else None


# -- the parity check -----------------------------------------------------------------------------------------


def mean_losses(results: list[dict]) -> list[float]:
    """The global-batch loss of each step: ranks see equal micro-batch sizes, so the mean of theirs."""
    return [sum(r["losses"][i] for r in results) / len(results) for i in range(len(results[0]["losses"]))]


def assert_matches_reference(
    results: list[dict], ref_losses: list[float], ref_state: dict[str, torch.Tensor], dtype: str = "fp32"
) -> None:
    """The ranks' losses and final weights are the reference's (the module docstring's tolerances for
    `dtype`), and every rank sees the same full weights."""
    loss_rtol = 1e-5 if dtype == "fp32" else 2e-2
    assert mean_losses(results) == pytest.approx(ref_losses, rel=loss_rtol)
    assert_weights_close(results[0]["state"], ref_state, dtype)
    for other in results[1:]:
        for key, value in results[0]["state"].items():
            assert torch.equal(other["state"][key], value), key


def assert_matches_plain_pytorch(
    results: list[dict],
    kind: str,
    steps: int,
    micro_bs: int,
    *,
    grad_accum: int = 1,
    clip: float = 1.0,
    dtype: str = "fp32",
    device: torch.device | str = "cpu",
) -> None:
    """`assert_matches_reference` of the ranks' `train_on_rank` results for `kind` (`micro_bs` rows each) against
    `reference_for` the same global batches, trained on `device`."""
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    ref = reference_for(
        kind, steps, micro_bs * len(results), grad_accum=grad_accum, clip=clip, dtype=torch_dtype, device=device
    )
    assert_matches_reference(results, ref.losses, ref.state, dtype)


MIN_OUTLIERS = 4  # a small tensor (a 32-wide norm) may hold a few outliers too, not only a fraction


def assert_weights_close(state: dict, ref_state: dict, dtype: str = "fp32") -> None:
    """Every weight within `bulk` of the reference but for a few outliers, and those within `worst`."""
    bulk, bulk_rel, outlier_frac, worst = (2e-6, 0.0, 5e-3, 1e-4) if dtype == "fp32" else (5e-3, 2**-6, 1e-2, 4e-2)
    assert list(state) == list(ref_state)
    for key, ref in ref_state.items():
        diff = (state[key] - ref).abs()
        assert diff.max().item() <= worst, f"{key}: max |diff| {diff.max().item():.3g} > {worst}"
        outliers = int((diff > bulk + bulk_rel * ref.abs()).sum().item())
        allowed = max(MIN_OUTLIERS, int(outlier_frac * ref.numel()))
        assert outliers <= allowed, (
            f"{key}: {outliers} of {ref.numel()} elements differ by more than {bulk} + {bulk_rel}|w|"
        )
