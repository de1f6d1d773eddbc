"""Squared L2 norms of gradient shards, for clipping and the fp16 overflow check.

A contiguous host tensor in fp32, bf16 or fp16 is read once by the native kernel at memory bandwidth
(torch's `vector_norm` reads a bf16 buffer at a tenth of that); anything else (a device tensor) goes
through torch. Both sum in fp32 and return a Python float; inf and nan propagate. A flat's gradient is
summed parameter by parameter where it is whole, so that the parameters' own gradients give the same norm
without being copied into a flat first.
"""

from __future__ import annotations

import os

import torch

from infinity._native_loader import load_native
from infinity.partition.flat_param import FlatParam

_NATIVE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def norm_sq(t: torch.Tensor) -> float:
    """Sum of the squares of `t`'s elements."""
    dtype = _NATIVE_DTYPES.get(t.dtype)
    if t.device.type != "cpu" or dtype is None or not t.is_contiguous():
        return float(torch.linalg.vector_norm(t, dtype=torch.float32)) ** 2
    simd = os.environ.get("INFINITY_SIMD") or "auto"  # the Adam kernels' override, read here without importing optim
    return load_native().norm.sum_squares(t.data_ptr(), t.numel(), dtype, simd, torch.get_num_threads())


def flat_norm_sq(flat: FlatParam, grad: torch.Tensor) -> float:
    """Sum of the squares of `flat`'s gradient shard `grad`. Where the shard is the whole flat (one rank) it is
    summed parameter by parameter, so that it is the same bits as `param_grads_norm_sq` of the gradients it was
    made from: a step may take either."""
    if grad.numel() != flat.padded_numel or grad.device.type != "cpu":  # (on a device each sum waits for it)
        return norm_sq(grad)
    total = sum(norm_sq(grad[slot.offset : slot.offset + slot.numel]) for slot in flat.slots)
    return total + norm_sq(grad[flat.numel :])  # the padding: zeros where the parameters made it (adds 0.0)


def param_grads_norm_sq(flat: FlatParam) -> float:
    """`flat_norm_sq` of the flat the parameters' gradients would make (a parameter without one counts zero),
    read from the gradients themselves: no flat copy is made. In another dtype than the flat's, only where
    that conversion is exact (16-bit gradients to fp32)."""
    return sum(norm_sq(g.contiguous()) for g in flat.grads() if g is not None)
