"""Per-rank sessions of the engine feature tests, and optimizers as a user writes them.

Everything `run_distributed` calls lives at module level (the harness pickles functions by reference). A
session trains with infinity and returns plain data (losses, full state dicts, probes) that the test compares
with plain PyTorch; the plain training loop, config, models and data are `harness`'s and `toy_models`'s.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from harness import LR, WEIGHT_DECAY, config, config_adamw, cpu_state, rank_and_world, train_steps
from torch import nn
from toy_models import batches, make_model

import infinity
from infinity.scheduler import Phase

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


def half_per_step(step: int) -> float:
    return 0.5**step


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
    cfg = config("mlp", extra_zero={"comm_timeout_s": comm_timeout_s})
    engine, _, _, _ = infinity.initialize(model=make_model("mlp"), config=cfg)
    rank = dist.get_rank()
    data = batches("mlp", 2, rank=rank, world_size=2)
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
        infinity.initialize(model=make_model("mlp"), config=config)
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
    model = make_model("mlp")
    engine, _, _, _ = infinity.initialize(model=model, config=config("mlp", persistence=32))
    data = batches("mlp", 2, rank=rank, world_size=world)

    def train(n: int) -> list[float]:
        return train_steps(engine, data, n)

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
    model = make_model("mlp")
    data = batches("mlp", global_bs)
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
    model = make_model("skipping")
    cfg = config("skipping")
    if nvme_path is not None:
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_path}
    engine, _, _, _ = infinity.initialize(model=model, config=cfg)
    seen: list[dict[int, bool]] = []

    def watcher(block):
        def hook(module, args):
            if torch.is_grad_enabled() and engine.scheduler.phase is not Phase.BACKWARD:
                seen[-1][block.index] = block.unsharded or block.in_flight

        return hook

    for block in engine.blocks:
        block.module.register_forward_pre_hook(watcher(block), prepend=True)
    data = batches("skipping", 2, rank=rank, world_size=world)
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
    engine, _, _, _ = infinity.initialize(model=make_model("mlp"), config=config("mlp", grad_accum=grad_accum))
    data = batches("mlp", 2, rank=rank, world_size=world)
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
    cfg = config("mlp", extra={"fp16": {"enabled": True, "initial_scale_power": initial_scale_power, "hysteresis": 1}})
    engine, _, _, _ = infinity.initialize(model=make_model("mlp"), config=cfg)
    data = batches("mlp", 2, rank=rank, world_size=world, dtype=torch.float16)
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


def modify_gathered_weight_without_modifier_rank() -> dict:
    """Right after initialize (persistent parameters are still gathered), rank 0 alone writes 7.0 into
    layers.0.fc.bias (persistent) inside GatheredParameters without modifier_rank; then every rank runs a
    forward. The write must be discarded everywhere."""
    rank, _ = rank_and_world()
    model = make_model("mlp")
    engine, _, _, _ = infinity.initialize(model=model, config=config("mlp", persistence=32))
    was_gathered = engine.persistent.unsharded
    with infinity.GatheredParameters([model.layers[0].fc.bias]):
        if rank == 0:
            with torch.no_grad():
                model.layers[0].fc.bias.fill_(7.0)
    with torch.no_grad():
        output = engine(probe_input())[0].clone()
    return {"was_gathered": was_gathered, "output": output, "state": engine.full_state_dict()}
