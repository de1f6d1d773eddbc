"""The out-of-core step's lower bound: the fewest bytes the step must move at fio's bandwidth, and the compute.

Minimum bytes per step for P parameters, all state on NVMe, one rank, compute dtype of c bytes (4 fp32,
2 bf16) and moments of m bytes per parameter (fp32 8, bf16 4, 8bit 2 + 8 per 256-element run):

    forward_param_read    c*P        each block's parameters read once for forward
    backward_state_read   (4 + m)*P  the fp32 master and moments read once: the backward's parameters are
                                     that master (fp32: the parameter shard is the master; bf16: cast from it)
                                     and the step, run while backward goes on, updates it in the same pass
    state_write           (4 + m)*P  master and moments written once
    param_shard_write     c*P        bf16 only: the new 16-bit shard (fp32: it is the master)
    gradients             0          the step consumes each block's gradient during backward

`unfused` adds the backward's own read of the c-byte parameter shard, for a step that reads the master
apart. On disk: the master, the moments and (bf16) the 16-bit shard, (4 + m + c)*P or (4 + m)*P in fp32.

io_s = read / fio_read + write / fio_write (one disk: reads and writes share it); io_s_overlap =
max(read / fio_read, write / fio_write), the looser bound if the disk read and wrote at full speed at once.
compute_s: forward + backward of one layer in plain PyTorch in memory, times n_layer, plus the
embeddings / final norm / head / loss once. bound_s = max(compute_s, io_s).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from benchlib import shapes
from benchlib.measure import median_time

MOMENT_BYTES = {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0 + 8.0 / 256}  # per parameter, both moments
MASTER_BYTES = 4
COMPUTE_BYTES = {"fp32": 4, "bf16": 2}  # per parameter, by compute dtype


def min_step_bytes(params: int, compute_bytes: int, moments: str) -> dict[str, Any]:
    """The fewest bytes one step must read and write (see the module doc), with its parts."""
    state = (MASTER_BYTES + MOMENT_BYTES[moments]) * params
    parts = {
        "forward_param_read": compute_bytes * params,
        "backward_state_read": state,
        "state_write": state,
        "param_shard_write": 0 if compute_bytes == MASTER_BYTES else compute_bytes * params,
        "gradients": 0,
    }
    read = parts["forward_param_read"] + parts["backward_state_read"]
    write = parts["state_write"] + parts["param_shard_write"]
    return {
        "read_bytes": int(read),
        "write_bytes": int(write),
        "bytes_per_param": (read + write) / params,
        "parts": {k: int(v) for k, v in parts.items()},
        "unfused_read_bytes": int(read + compute_bytes * params),
    }


def min_disk_bytes_per_param(compute_bytes: int, moments: str) -> float:
    shard = 0 if compute_bytes == MASTER_BYTES else compute_bytes
    return MASTER_BYTES + MOMENT_BYTES[moments] + shard


def io_bound(read_bytes: float, write_bytes: float, read_gbps: float, write_gbps: float) -> dict[str, float]:
    """Seconds to move these bytes at fio's bandwidth: additive (one disk) and overlapped."""
    read_s, write_s = read_bytes / (read_gbps * 1e9), write_bytes / (write_gbps * 1e9)
    return {"io_s": read_s + write_s, "io_s_overlap": max(read_s, write_s)}


# -- the in-memory reference of the compute (runs in a child process: its memory is not the run's) ------------


def block_fwd_bwd_s(arch: str, cfg: Any, batch: int, seq: int, dtype: Any, reps: int) -> tuple[float, int]:
    """(median seconds of forward+backward of one layer in plain PyTorch, the layer's parameter count)."""
    import torch

    torch.manual_seed(0)
    layer = shapes.build(arch, replace(cfg, n_layer=1))
    block = (layer.blocks if arch == "gpt" else layer.layers)[0].to(dtype)
    x = torch.randn(batch, seq, cfg.n_embd, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(batch, seq, cfg.n_embd, dtype=dtype)

    def step() -> None:
        block(x).backward(grad_out)
        block.zero_grad(set_to_none=True)  # the engine's gradients are fresh buffers each backward too
        x.grad = None

    return median_time(step, reps), sum(p.numel() for p in block.parameters())


def head_fwd_bwd_s(arch: str, cfg: Any, batch: int, seq: int, dtype: Any, reps: int) -> float:
    """Forward+backward of the embeddings, final norm, head and loss (the model with no layers)."""
    import torch
    import torch.nn.functional as F

    model = shapes.build(arch, replace(cfg, n_layer=0)).to(dtype)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq))

    def step() -> None:
        logits, _ = model(idx)
        F.cross_entropy(logits.float().view(-1, logits.size(-1)), idx.reshape(-1)).backward()
        model.zero_grad(set_to_none=True)

    return median_time(step, reps)


def adam_s_per_elem(elems: int, dtype: Any, reps: int) -> float:
    """The native CPU AdamW (the engine's kernel, fp32 moments) over `elems` elements in memory, per element."""
    import torch

    from infinity.optim.cpu_adam import adam_step_flat

    master, grad, m, v = (torch.randn(elems) for _ in range(4))
    v.abs_()
    out = torch.empty(elems, dtype=dtype) if dtype != torch.float32 else None
    steps = iter(range(1, 1 << 30))

    def step() -> None:
        adam_step_flat(
            master, grad, m, v, step=next(steps), lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
            adamw_mode=True, out_copy=out,
        )  # fmt: skip

    return median_time(step, reps) / elems


def compute_in_memory(arch: str, cfg: Any, batch: int, seq: int, dtype: Any, reps: int = 5) -> dict[str, float]:
    """The in-memory reference of the step's compute: one layer, the head, and Adam per element."""
    block_s, block_elems = block_fwd_bwd_s(arch, cfg, batch, seq, dtype, reps)
    return {
        "block_fwd_bwd_s": block_s,
        "head_fwd_bwd_s": head_fwd_bwd_s(arch, cfg, batch, seq, dtype, reps),
        "block_elems": block_elems,
        "adam_s_per_elem": adam_s_per_elem(block_elems, dtype, reps),
    }
