"""Models, data, plain-PyTorch references and per-rank functions for the engine feature tests.

Everything `run_distributed` calls lives here at module level (the harness pickles functions by reference).
A rank function trains with infinity and returns plain data (losses, full state dicts, probes); the test
process trains the same model on the same global batches with plain PyTorch (`plain_train`) and compares.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from engine_cases import LR, SEQ, WEIGHT_DECAY
from torch import nn
from torch.utils.checkpoint import checkpoint

import infinity
from infinity.models.gpt import GPT, gpt_preset
from infinity.models.mlp import MLP, MLPLayer
from infinity.scheduler import Phase

# -- models ------------------------------------------------------------------------------------------


class ReusedLayerNet(nn.Module):
    """One MLPLayer (a block) applied twice per forward, at two depths, with the same weights."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = MLPLayer(16, 24)
        self.shared = MLPLayer(24, 24)
        self.out = MLPLayer(24, 24)
        self.head = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        h = self.shared(self.shared(self.inp(x)))
        out = self.head(self.out(h))
        return out, None if targets is None else F.mse_loss(out, targets)


class SharedLinearNet(nn.Module):
    """One nn.Linear registered in two different blocks (layers.1.fc is layers.2.fc)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MLPLayer(16, 24), MLPLayer(24, 24), MLPLayer(24, 24), MLPLayer(24, 24)])
        self.layers[2].fc = self.layers[1].fc
        self.head = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        for layer in self.layers:
            x = layer(x)
        out = self.head(x)
        return out, None if targets is None else F.mse_loss(out, targets)


class ScaledLayer(nn.Module):
    """A block with buffers used in forward: a fixed per-feature scale, a non-persistent position-id buffer
    and a running mean of |activation| that forward updates in training mode (as BatchNorm's stats)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, n_out))
        self.register_buffer("pos_ids", torch.arange(n_out), persistent=False)
        self.register_buffer("running", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * self.scale + 0.01 * self.pos_ids
        if self.training:
            with torch.no_grad():
                self.running.mul_(0.5).add_(0.5 * h.abs().mean())
        return F.gelu(h / self.running)


class BufferNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ScaledLayer(16, 24), ScaledLayer(24, 24)])
        self.head = nn.Linear(24, 8)
        self.register_buffer("out_shift", torch.full((8,), 0.25))

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        for layer in self.layers:
            x = layer(x)
        out = self.head(x) + self.out_shift
        return out, None if targets is None else F.mse_loss(out, targets)


class SkippingMLP(MLP):
    """An MLP whose forward skips layers[1] when asked (`skip=True`): the block order changes between steps."""

    def __init__(self) -> None:
        super().__init__(in_features=16, hidden=24, out_features=8, n_layers=4)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, skip: bool = False):
        for i, layer in enumerate(self.layers):
            if not (skip and i == 1):
                x = layer(x)
        out = self.head(x)
        return out, None if targets is None else F.mse_loss(out, targets)


class ReentrantCheckpointGPT(GPT):
    """The tiny GPT with each block under torch.utils.checkpoint(use_reentrant=True): the first forward runs
    the blocks without autograd, and backward re-runs each block's forward before its backward."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True) if torch.is_grad_enabled() else block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def make_feature_model(kind: str, seed: int = 0) -> nn.Module:
    """The models of these tests; `kind` names one. Seeded, so every call builds the same weights."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP(in_features=16, hidden=24, out_features=8, n_layers=3)
    if kind == "mlp4":
        return MLP(in_features=16, hidden=24, out_features=8, n_layers=4)
    if kind == "odd":  # 7x13, 5x7 ...: no size divides by 2, nor by the 1024-element shard alignment
        return MLP(in_features=13, hidden=7, out_features=5, n_layers=3)
    if kind == "reused":
        return ReusedLayerNet()
    if kind == "shared_linear":
        return SharedLinearNet()
    if kind == "buffers":
        return BufferNet()
    if kind == "skipping":
        return SkippingMLP()
    if kind == "gpt_reentrant":  # the same weights as engine_cases.make_model("gpt")
        return ReentrantCheckpointGPT(gpt_preset("tiny", bias=False, block_size=SEQ))
    raise KeyError(kind)


def frozen_model(seed: int = 0) -> nn.Module:
    """mlp4 with layers[1] (a whole block), layers[2].fc.bias (part of a block) and head.bias frozen."""
    model = make_feature_model("mlp4", seed)
    for p in model.layers[1].parameters():
        p.requires_grad_(False)
    model.layers[2].fc.bias.requires_grad_(False)
    model.head.bias.requires_grad_(False)
    return model


FROZEN = ("layers.1.fc.weight", "layers.1.fc.bias", "layers.2.fc.bias", "head.bias")


def build(kind: str, seed: int = 0) -> nn.Module:
    return frozen_model(seed) if kind == "frozen" else make_feature_model(kind, seed)


def io_sizes(kind: str) -> tuple[int, int]:
    return (13, 5) if kind == "odd" else (16, 8)


def feature_batches(
    kind: str, micro_bs: int, seed: int = 0, rank: int = 0, world_size: int = 1, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Random regression batches; rank r's rows of global micro-batch s are rows [r*b, (r+1)*b)."""
    n_in, n_out = io_sizes(kind)
    step = 0
    while True:
        gen = torch.Generator().manual_seed(seed * 7919 + step)
        x = torch.randn(micro_bs * world_size, n_in, generator=gen)
        y = torch.randn(micro_bs * world_size, n_out, generator=gen)
        rows = slice(rank * micro_bs, (rank + 1) * micro_bs)
        yield x[rows].to(dtype), y[rows].to(dtype)
        step += 1


def feature_config(
    *,
    micro_bs: int = 2,
    grad_accum: int = 1,
    clip: float = 1.0,
    block_classes: tuple[str, ...] = ("MLPLayer",),
    persistence: int = 0,
    offload: str = "none",
    extra: dict | None = None,
    extra_zero: dict | None = None,
) -> dict:
    """A ds_config for the small models: every parameter sharded unless `persistence` says otherwise."""
    cfg = {
        "train_micro_batch_size_per_gpu": micro_bs,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {
            "stage": 3,
            "block_classes": list(block_classes),
            "stage3_param_persistence_threshold": persistence,
            "offload_param": {"device": offload},
            "offload_optimizer": {"device": offload},
            **(extra_zero or {}),
        },
    }
    cfg.update(extra or {})
    return cfg


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- optimizers as a user writes them ---------------------------------------------------------------


def no_decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The usual split: weight decay on matrices, none on biases (1-D parameters); a larger lr on the head."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and not n.startswith("head.")]
    head = [p for n, p in model.named_parameters() if p.ndim >= 2 and n.startswith("head.")]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": head, "weight_decay": WEIGHT_DECAY, "lr": 2 * LR},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def client_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(no_decay_groups(model), lr=LR, betas=(0.8, 0.99), eps=1e-7, foreach=False)


def client_adam_l2(model: nn.Module) -> torch.optim.Optimizer:
    """torch.optim.Adam with weight_decay: L2 added to the gradient, not decoupled."""
    return torch.optim.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)


def config_adamw(model: nn.Module) -> torch.optim.Optimizer:
    """What the config's optimizer section means: AdamW(lr, weight_decay) over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)


def half_per_step(step: int) -> float:
    return 0.5**step


# -- the plain PyTorch yardstick --------------------------------------------------------------------


def plain_train(
    model: nn.Module,
    data: Iterator,
    steps: int,
    *,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] = config_adamw,
    grad_accum: int = 1,
    clip: float = 1.0,
    step_kwargs: Callable[[int], dict] | None = None,
    lr_lambda: Callable[[int], float] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor], list[list[float]]]:
    """Plain PyTorch on one process: (per-step mean loss, final state_dict, lr of each group at each step).

    As the engine: each micro-batch's loss divided by `grad_accum`, gradients summed, clipped by global norm
    over the parameters that have gradients, one optimizer step; `lr_lambda` drives a LambdaLR.
    """
    opt = make_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda is not None else None
    losses, lrs = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(grad_accum):
            x, y = next(data)
            _, loss = model(x, y, **(step_kwargs(step) if step_kwargs else {}))
            (loss / grad_accum).backward()
            total += loss.item() / grad_accum
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(total)
    return losses, cpu_state(model), lrs


# -- per-rank functions -------------------------------------------------------------------------------


def train_features(
    kind: str,
    config: dict,
    steps: int,
    micro_bs: int,
    *,
    client_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    groups_as_model_parameters: bool = False,
    step_kwargs: Callable[[int], dict] | None = None,
    scheduler_factory: Callable | None = None,
    user_lr_lambda: Callable[[int], float] | None = None,
    seed: int = 0,
) -> dict:
    """Train `build(kind)` with infinity on this rank; return losses, the full state dict and what it saw.

    `client_optimizer` is passed as initialize(optimizer=...); `groups_as_model_parameters` passes the
    no-decay groups as model_parameters instead; `scheduler_factory` is passed as lr_scheduler (a callable
    taking the engine's optimizer); `user_lr_lambda` builds a LambdaLR on the returned optimizer that this
    loop steps after each engine.step(), as a user would.
    """
    rank, world = rank_and_world()
    model = build(kind, seed)
    initial = cpu_state(model)
    kwargs: dict[str, Any] = {}
    if client_optimizer is not None:
        kwargs["optimizer"] = client_optimizer(model)
    if groups_as_model_parameters:
        kwargs["model_parameters"] = no_decay_groups(model)
    if scheduler_factory is not None:
        kwargs["lr_scheduler"] = scheduler_factory
    engine, optimizer, _, _ = infinity.initialize(model=model, config=config, **kwargs)
    user_sched = torch.optim.lr_scheduler.LambdaLR(optimizer, user_lr_lambda) if user_lr_lambda else None
    data = feature_batches(kind, micro_bs, seed=seed, rank=rank, world_size=world)
    losses, lrs = [], []
    for step in range(steps):
        total = 0.0
        lrs.append(engine.get_lr())
        for _ in range(engine.gradient_accumulation_steps):
            x, y = next(data)
            _, loss = engine(x, y, **(step_kwargs(step) if step_kwargs else {}))
            engine.backward(loss)
            engine.step()
            total += loss.item() / engine.gradient_accumulation_steps
        if user_sched is not None:
            user_sched.step()
        losses.append(total)
    return {
        "losses": losses,
        "state": engine.full_state_dict(),
        "initial": initial,
        "lrs": lrs,
    }


def mean_losses(results: list[dict]) -> list[float]:
    return [sum(r["losses"][i] for r in results) / len(results) for i in range(len(results[0]["losses"]))]


def reference_for(
    kind: str, steps: int, global_bs: int, *, grad_accum: int = 1, clip: float = 1.0, seed: int = 0, **kwargs
) -> tuple[list[float], dict[str, torch.Tensor], list[list[float]]]:
    model = build(kind, seed)
    data = feature_batches(kind, global_bs, seed=seed)
    return plain_train(model, data, steps, grad_accum=grad_accum, clip=clip, **kwargs)


# -- a launcher that lets one rank die and reports what the others did --------------------------------


def _surviving_worker(rank: int, world_size: int, port: int, conn, fn: Callable, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    torch.set_num_threads(1)
    try:
        payload = ("ok", fn(*args))
    except BaseException as e:  # noqa: B036 - the test wants to see exactly what the rank raised
        payload = ("error", (type(e).__name__, str(e), time.monotonic(), traceback.format_exc()))
    conn.send(payload)
    conn.close()


def run_until_stopped(
    fn: Callable, world_size: int, *args: Any, watch: tuple[int, ...] = (0,), timeout_s: float = 60
) -> dict[int, tuple[str, Any]]:
    """Run `fn(*args)` on `world_size` ranks that join the process group themselves (so the engine's
    `comm_timeout_s` applies) and wait until each rank in `watch` has ended, unlike `run_distributed`, which
    stops at the first rank that fails. Returns each watched rank's outcome: ("ok", result),
    ("error", (type name, message, monotonic time, traceback)), ("died", exit code), or ("hung", None) if
    it was still running after `timeout_s`. Every rank still running at the end is killed."""
    from datetime import timedelta

    from dist import _context

    ctx = _context()  # the harness's forkserver, with torch preloaded
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    procs, conns = [], []
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_surviving_worker, args=(rank, world_size, store.port, send, fn, args), daemon=True)
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        deadline = time.monotonic() + timeout_s
        outcomes: dict[int, tuple[str, Any]] = {}
        for rank in watch:
            if conns[rank].poll(max(0.0, deadline - time.monotonic())):
                try:
                    outcomes[rank] = conns[rank].recv()
                    continue
                except EOFError:
                    pass
            procs[rank].join(max(0.0, min(5.0, deadline - time.monotonic())))
            outcomes[rank] = ("hung", None) if procs[rank].is_alive() else ("died", procs[rank].exitcode)
        return outcomes
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        for c in conns:
            c.close()
        del store


def rank1_dies_mid_step(comm_timeout_s: float, die_at_step: int, hang_instead: bool = False) -> dict:
    """Train the MLP on 2 ranks; at `die_at_step` rank 1 exits (os._exit) between its forward and backward,
    or with `hang_instead` sleeps there. Rank 0 reports what it raised and how long it waited first."""
    cfg = feature_config(extra_zero={"comm_timeout_s": comm_timeout_s})
    engine, _, _, _ = infinity.initialize(model=build("mlp"), config=cfg)
    rank = dist.get_rank()
    data = feature_batches("mlp", 2, rank=rank, world_size=2)
    for step in range(die_at_step + 3):
        start = time.monotonic()
        try:
            x, y = next(data)
            _, loss = engine(x, y)
            if rank == 1 and step == die_at_step:
                if hang_instead:
                    time.sleep(10 * comm_timeout_s + 60)
                os._exit(3)
            engine.backward(loss)
            engine.step()
        except Exception as e:
            return {"step": step, "waited_s": time.monotonic() - start, "type": type(e), "message": str(e)}
    return {"step": None}


def batch_size_error_on_two_ranks(config: dict) -> str:
    """initialize() with `config` on this rank; the error message it raised ('' if none)."""
    try:
        infinity.initialize(model=build("mlp"), config=config)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


# -- GatheredParameters ---------------------------------------------------------------------------------

PROBE_INPUT_SEED = 99


def probe_input() -> torch.Tensor:
    return torch.randn(3, 16, generator=torch.Generator().manual_seed(PROBE_INPUT_SEED))


def gathered_parameters_session(steps_before: int, steps_after: int) -> dict:
    """Train, look at and modify weights inside GatheredParameters, train on; report what each rank saw.

    Rank 0 writes 0.5 into layers.1.fc.weight and 0.25 into layers.0.fc.bias (a persistent parameter) under
    modifier_rank=0 while rank 1 writes -3.0 (to be overwritten by rank 0's values); before that, every rank
    writes 7.0 into all weights without modifier_rank (to be discarded).
    """
    rank, world = rank_and_world()
    model = build("mlp")
    engine, _, _, _ = infinity.initialize(model=model, config=feature_config(persistence=32))
    data = feature_batches("mlp", 2, rank=rank, world_size=world)

    def train(n: int) -> list[float]:
        losses = []
        for _ in range(n):
            x, y = next(data)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    out: dict[str, Any] = {"losses": train(steps_before)}
    out["state_before"] = engine.full_state_dict()
    params = dict(model.named_parameters())
    with infinity.GatheredParameters(list(params.values())):
        out["inside"] = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for p in params.values():
                p.fill_(7.0)
    out["blocks_gathered_after_read"] = [b.unsharded and not b.resident for b in engine.blocks]
    out["state_after_unmodified"] = engine.full_state_dict()
    with torch.no_grad():
        out["output_after_unmodified"] = engine(probe_input())[0].detach().clone()
    with infinity.GatheredParameters([params["layers.1.fc.weight"], params["layers.0.fc.bias"]], modifier_rank=0):
        with torch.no_grad():
            params["layers.1.fc.weight"].fill_(0.5 if rank == 0 else -3.0)
            params["layers.0.fc.bias"].fill_(0.25 if rank == 0 else -3.0)
    out["state_after_modified"] = engine.full_state_dict()
    with torch.no_grad():
        out["output_after_modified"] = engine(probe_input())[0].detach().clone()
    out["losses"] += train(steps_after)
    out["state"] = engine.full_state_dict()
    return out


def plain_with_modification(steps_before: int, steps_after: int, global_bs: int) -> dict:
    """The reference for `gathered_parameters_session`: same training, the same in-place edit of two weights
    between the steps (the AdamW state carries on, as the engine's does)."""
    model = build("mlp")
    data = feature_batches("mlp", global_bs)
    opt = config_adamw(model)
    losses = []

    def train(n: int) -> None:
        for _ in range(n):
            x, y = next(data)
            opt.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())

    train(steps_before)
    out: dict[str, Any] = {"state_before": cpu_state(model)}
    with torch.no_grad():
        out["output_unmodified"] = model(probe_input())[0]
        model.layers[1].fc.weight.fill_(0.5)
        model.layers[0].fc.bias.fill_(0.25)
        out["state_modified"] = cpu_state(model)
        out["output_modified"] = model(probe_input())[0]
    train(steps_after)
    out["state"] = cpu_state(model)
    out["losses"] = losses
    return out


# -- inference ----------------------------------------------------------------------------------------


def eval_session(kind: str, config: dict, steps_before: int, steps_after: int, micro_bs: int) -> dict:
    """Train, run inference in eval mode under no_grad (and inference_mode), train on; report what was seen."""
    from engine_cases import batches, make_model

    rank, world = rank_and_world()
    engine, _, _, _ = infinity.initialize(model=make_model(kind), config=config)
    data = batches(kind, micro_bs, rank=rank, world_size=world)
    probe_x, probe_y = next(batches(kind, micro_bs, seed=5, rank=rank, world_size=world))

    def train(n: int) -> list[float]:
        losses = []
        for _ in range(n):
            x, y = next(data)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    out: dict[str, Any] = {"losses": train(steps_before)}
    out["state_before"] = engine.full_state_dict()
    engine.eval()
    with torch.no_grad():
        logits, loss = engine(probe_x, probe_y)
    out["eval_logits"], out["eval_loss"] = logits.clone(), loss.item()
    # a resident block (one rank: its parameters are views of its shard) holds nothing beyond its shard
    held = [b for b in (*engine.blocks, engine.root) if not b.resident]
    out["resident_blocks"] = len(engine.blocks) + 1 - len(held)
    out["gathered_after_no_grad"] = [b.unsharded for b in held]
    out["in_flight_after_no_grad"] = [b.in_flight for b in engine.blocks]
    with torch.inference_mode():
        logits2, _ = engine(probe_x, probe_y)
    out["inference_mode_logits"] = logits2.clone()
    out["gathered_after_inference_mode"] = [b.unsharded for b in held]
    out["probe_rows"] = (probe_x, probe_y)
    engine.train()
    out["losses"] += train(steps_after)
    out["state"] = engine.full_state_dict()
    return out


# -- the recorded order: prefetch, and data-dependent control flow -------------------------------------


def skip_on_steps_2_to_4(step: int) -> dict:
    return {"skip": 2 <= step <= 4}


def control_flow_session(steps: int, nvme_path: str | None = None) -> dict:
    """Train SkippingMLP (layers[1] skipped on steps 2-4) and watch the scheduler.

    Before each block's forward pre-hook runs (a hook prepended ahead of the scheduler's), record whether
    the block is already gathered or being gathered: that is a prefetch. Also per step: the trace's
    invalidation count and the recorded forward order after the step. With `nvme_path` the parameters
    live on NVMe there (one rank keeps in-memory shards resident, so only then are its blocks gathered).
    """
    rank, world = rank_and_world()
    model = build("skipping")
    config = feature_config()
    if nvme_path is not None:
        config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_path}
    engine, _, _, _ = infinity.initialize(model=model, config=config)
    seen: list[dict[int, bool]] = []

    def watcher(block):
        def hook(module, args):
            if torch.is_grad_enabled() and engine.scheduler.phase is not Phase.BACKWARD:
                seen[-1][block.index] = block.unsharded or block.in_flight

        return hook

    for block in engine.blocks:
        block.module.register_forward_pre_hook(watcher(block), prepend=True)
    data = feature_batches("skipping", 2, rank=rank, world_size=world)
    losses, invalidations, orders = [], [], []
    for step in range(steps):
        seen.append({})
        x, y = next(data)
        _, loss = engine(x, y, **skip_on_steps_2_to_4(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        invalidations.append(engine.scheduler.forward_trace.invalidations)
        orders.append(list(engine.scheduler.forward_trace.order))
    return {
        "losses": losses,
        "state": engine.full_state_dict(),
        "ready_before_pre_hook": seen,
        "invalidations": invalidations,
        "orders": orders,
    }


# -- gradient accumulation ------------------------------------------------------------------------------


def accumulation_session(grad_accum: int, steps: int) -> dict:
    """Per micro-step: the boundary flag (asked before engine.step()), global_steps after it, and whether
    the weights changed in that micro-step."""
    rank, world = rank_and_world()
    engine, _, _, _ = infinity.initialize(model=build("mlp"), config=feature_config(grad_accum=grad_accum))
    data = feature_batches("mlp", 2, rank=rank, world_size=world)
    boundaries, global_steps, changed, losses = [], [], [], []
    state = engine.full_state_dict()
    for _ in range(steps * grad_accum):
        x, y = next(data)
        _, loss = engine(x, y)
        engine.backward(loss)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.step()
        global_steps.append(engine.global_steps)
        new = engine.full_state_dict()
        changed.append(any(not torch.equal(new[k], state[k]) for k in new))
        state = new
        losses.append(loss.item())
    step_losses = [sum(losses[i : i + grad_accum]) / grad_accum for i in range(0, len(losses), grad_accum)]
    return {
        "boundaries": boundaries,
        "global_steps": global_steps,
        "changed": changed,
        "losses": step_losses,
        "state": state,
    }


# -- fp16 loss scaling ----------------------------------------------------------------------------------


def fp16_session(initial_scale_power: int, steps: int, inf_at_step: int | None, inf_on_rank: int = 0) -> dict:
    """Train the MLP in fp16 with dynamic loss scaling (hysteresis 1). At `inf_at_step`, rank `inf_on_rank`
    multiplies its loss by inf. Per step: scale before the step, skipped_steps and global_steps after it,
    whether any weight changed, and the loss."""
    rank, world = rank_and_world()
    cfg = feature_config(extra={"fp16": {"enabled": True, "initial_scale_power": initial_scale_power, "hysteresis": 1}})
    engine, _, _, _ = infinity.initialize(model=build("mlp"), config=cfg)
    data = feature_batches("mlp", 2, rank=rank, world_size=world, dtype=torch.float16)
    rows: list[dict[str, Any]] = []
    state = engine.full_state_dict()
    for step in range(steps):
        scale = engine.loss_scaler.scale
        x, y = next(data)
        _, loss = engine(x, y)
        row = {"scale": scale, "loss": loss.item(), "loss_dtype": str(loss.dtype)}
        if step == inf_at_step and rank == inf_on_rank:
            loss = loss * math.inf
        engine.backward(loss)
        engine.step()
        new = engine.full_state_dict()
        row.update(
            skipped=engine.skipped_steps,
            global_steps=engine.global_steps,
            changed=any(not torch.equal(new[k], state[k]) for k in new),
        )
        state = new
        rows.append(row)
    return {"rows": rows, "state": state}


def train_gpt_watching_the_trace(kind: str, config: dict, steps: int, micro_bs: int) -> dict:
    """engine_cases.train_infinity for `make_feature_model(kind)`, plus the forward trace's invalidations."""
    from engine_cases import batches

    rank, world = rank_and_world()
    engine, _, _, _ = infinity.initialize(model=make_feature_model(kind), config=config)
    data = batches("gpt", micro_bs, rank=rank, world_size=world)
    losses = []
    for _ in range(steps):
        x, y = next(data)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "state": engine.full_state_dict(),
        "forward_invalidations": engine.scheduler.forward_trace.invalidations,
    }


def modify_gathered_weight_without_modifier_rank() -> dict:
    """Right after initialize (persistent parameters are still gathered), rank 0 alone writes 7.0 into
    layers.0.fc.bias (persistent) inside GatheredParameters without modifier_rank; then every rank runs a
    forward. The write must be discarded everywhere."""
    rank, _ = rank_and_world()
    model = build("mlp")
    engine, _, _, _ = infinity.initialize(model=model, config=feature_config(persistence=32))
    was_gathered = engine.persistent.unsharded
    with infinity.GatheredParameters([model.layers[0].fc.bias]):
        if rank == 0:
            with torch.no_grad():
                model.layers[0].fc.bias.fill_(7.0)
    with torch.no_grad():
        output = engine(probe_input())[0].clone()
    return {"was_gathered": was_gathered, "output": output, "state": engine.full_state_dict()}
