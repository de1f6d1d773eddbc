"""Squared L2 norms of gradient shards, for clipping and the fp16 overflow check.

A contiguous host tensor in fp32, bf16 or fp16 is read once by the native kernel at memory bandwidth
(torch's `vector_norm` reads a bf16 buffer at a tenth of that); anything else (a device tensor) goes
through torch. Both sum in fp32 and return a Python float; inf and nan propagate.
"""

from __future__ import annotations

import os

import torch

from infinity._native_loader import load_native

_NATIVE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def norm_sq(t: torch.Tensor) -> float:
    """Sum of the squares of `t`'s elements."""
    dtype = _NATIVE_DTYPES.get(t.dtype)
    if t.device.type != "cpu" or dtype is None or not t.is_contiguous():
        return float(torch.linalg.vector_norm(t, dtype=torch.float32)) ** 2
    simd = os.environ.get("INFINITY_SIMD") or "auto"  # the Adam kernels' override, read here without importing optim
    return load_native().norm.sum_squares(t.data_ptr(), t.numel(), dtype, simd, torch.get_num_threads())
