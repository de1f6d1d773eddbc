"""The native sum of squares behind gradient clipping: every SIMD path and dtype against an fp64 sum of
the same values, inf/nan seen, and the engine's `norm_sq` routing."""

from __future__ import annotations

import math

import pytest
import torch

from infinity._native_loader import load_native
from infinity.optim import supported_paths
from infinity.shards.grad_norm import norm_sq

PATHS = supported_paths()
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# around the 2048-element block, its vector steps, and enough for two threads' chunks
SIZES = [1, 7, 127, 2047, 2048, 2049, 5000, 300_001]


def _native(t: torch.Tensor, path: str, threads: int = 2) -> float:
    return load_native().norm.sum_squares(t.data_ptr(), t.numel(), DTYPES[t.dtype], path, threads)


def _fp64(t: torch.Tensor) -> float:
    return float(t.double().pow(2).sum())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", SIZES)
def test_sum_of_squares_matches_an_fp64_sum_of_the_same_values(path, dtype, n):
    t = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    assert _native(t, path) == pytest.approx(_fp64(t), rel=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_one_and_two_threads_agree_and_repeat_bit_for_bit(path):
    t = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0))
    one, two = _native(t, path, 1), _native(t, path, 2)
    assert one == pytest.approx(two, rel=1e-9) and one == pytest.approx(_fp64(t), rel=1e-7)
    assert _native(t, path, 2) == two


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_an_overflowed_element_anywhere_is_seen(path, dtype, bad):
    t = torch.ones(300_001, dtype=dtype)
    for where in (0, 150_000, 300_000):  # each thread's chunk, and the scalar tail
        t.fill_(1)
        t[where] = bad
        got = _native(t, path)
        assert math.isinf(got) if bad == math.inf else math.isnan(got)


def test_empty_is_zero_and_bad_arguments_say_what_is_wrong():
    norm = load_native().norm
    assert norm.sum_squares(0, 0, "float32", "auto", 1) == 0.0
    t = torch.ones(4)
    with pytest.raises(ValueError, match="dtype"):
        norm.sum_squares(t.data_ptr(), 4, "float64", "auto", 1)
    with pytest.raises(ValueError, match="simd"):
        norm.sum_squares(t.data_ptr(), 4, "float32", "sse9", 1)
    with pytest.raises(ValueError, match="num_threads"):
        norm.sum_squares(t.data_ptr(), 4, "float32", "auto", 0)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_norm_sq_reads_host_buffers_natively_and_anything_else_through_torch(dtype):
    t = torch.randn(64, 33, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert norm_sq(t) == pytest.approx(_fp64(t), rel=1e-5)  # contiguous: native
    assert norm_sq(t.t()) == pytest.approx(_fp64(t), rel=1e-5)  # a strided view: torch


def test_norm_sq_follows_the_simd_override(monkeypatch):
    t = torch.randn(10_000)
    monkeypatch.setenv("INFINITY_SIMD", "scalar")
    assert norm_sq(t) == _native(t, "scalar", torch.get_num_threads())
    monkeypatch.setenv("INFINITY_SIMD", "sse9")
    with pytest.raises(ValueError, match="sse9"):
        norm_sq(t)
