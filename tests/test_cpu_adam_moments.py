"""The native Adam with moments stored in bf16 and 8 bits equals the plain-PyTorch reference of each
format (`infinity.optim.adam_reference.stored_moments_step`: decode, torch's formula, encode) bit for
bit, on every SIMD path this CPU has; and CPUAdam/CPUAdamW keep, save and convert such state."""

import io

import pytest
import torch

from infinity.optim import CPUAdamW, adam_step_flat, supported_paths
from infinity.optim.adam_reference import stored_moments_step
from infinity.shards.moments import Q8_BLOCK_ELEMS, SCALE_NAMES, decode, encode, moment_format, zero_state

PATHS = supported_paths()
FORMATS = ("fp32", "bf16", "8bit")
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1, "adamw_mode": True}
# Odd lengths: under one vector, one block, a block and one, several blocks with vector tails.
LENGTHS = (1, 17, Q8_BLOCK_ELEMS - 1, Q8_BLOCK_ELEMS + 1, 1000, 8 * Q8_BLOCK_ELEMS + 37)


def stored_state(fmt: str, n: int, seed: int) -> dict[str, torch.Tensor]:
    """A mid-training state: moments spanning 40 decades; 8bit: random codes (every code occurs),
    scales from 1e-30 to 1e10, and some zero-scale blocks."""
    gen = torch.Generator().manual_seed(seed)
    state = zero_state(fmt, n)
    if fmt == "8bit":
        for name in ("exp_avg", "exp_avg_sq"):
            state[name].copy_(torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8))
            scale = 10.0 ** torch.empty(state[SCALE_NAMES[name]].numel()).uniform_(-30, 10, generator=gen)
            scale[::3] = 0.0
            state[SCALE_NAMES[name]].copy_(scale)
        return state
    m = torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-30, 10, generator=gen)
    v = m.square() * torch.rand(n, generator=gen) * 3
    for name, value in (("exp_avg", m), ("exp_avg_sq", v)):
        state[name].copy_(encode(value, fmt, name)[0])
    return state


def grads(n: int, steps: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lo = -7 if dtype == torch.float16 else -20
    return [(torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(lo, 2, generator=gen)).to(dtype)
            for _ in range(steps)]  # fmt: skip


def native_step(p, g, state, fmt, **kw) -> None:
    adam_step_flat(p, g, state["exp_avg"], state["exp_avg_sq"], moments=fmt, exp_avg_scale=state.get("exp_avg_scale"),
                   exp_avg_sq_scale=state.get("exp_avg_sq_scale"), **kw)  # fmt: skip


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bitwise equal, except that any NaN equals any NaN (torch and the kernel may keep other payloads)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if actual.is_floating_point():
        nan = torch.isnan(actual)
        assert torch.equal(nan, torch.isnan(expected)), f"{what}: NaNs in different places"
        actual, expected = actual[~nan], expected[~nan]
    a, e = actual.view(torch.uint8), expected.view(torch.uint8)
    bad = (a != e).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.numel()} bytes differ, first at byte {bad[0].item()}"


def run_both(path, fmt, n, grad_dtype, copy_dtype, steps=4, seed=0, grad_scale=0.75, state=None, grad_list=None):
    gen = torch.Generator().manual_seed(seed + 100)
    p = torch.randn(n, generator=gen)
    rp = p.clone()
    state = stored_state(fmt, n, seed) if state is None else state
    rstate = {k: v.clone() for k, v in state.items()}
    copy = None if copy_dtype is None else torch.empty(n, dtype=copy_dtype)
    rcopy = None if copy is None else copy.clone()
    for step, g in enumerate(grad_list or grads(n, steps, grad_dtype, seed + 1), start=1):
        native_step(p, g, state, fmt, step=step, out_copy=copy, grad_scale=grad_scale, simd=path, **HYPER)
        stored_moments_step(rp, g, rstate, fmt, out_copy=rcopy, step=step, grad_scale=grad_scale, **HYPER)
        assert_same_bits(p, rp, f"param after step {step}")
        for key in state:
            assert_same_bits(state[key], rstate[key], f"{key} after step {step}")
        if copy is not None:
            assert_same_bits(copy, rcopy, f"copy after step {step}")


@pytest.mark.parametrize("copy_dtype", (None, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("grad_dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", PATHS)
def test_step_equals_the_formats_reference_bitwise(path, fmt, grad_dtype, copy_dtype):
    for n in LENGTHS:
        run_both(path, fmt, n, grad_dtype, copy_dtype, seed=n)


@pytest.mark.parametrize("fmt", ("bf16", "8bit"))
@pytest.mark.parametrize("path", PATHS)
def test_long_shard_on_two_threads_equals_reference_and_one_thread(path, fmt):
    n = 1_000_003
    run_both(path, fmt, n, torch.bfloat16, torch.bfloat16, steps=2)
    results = []
    for threads in (1, 2):
        p, state = torch.ones(n), stored_state(fmt, n, 5)
        for step, g in enumerate(grads(n, 2, torch.float32, 6), start=1):
            native_step(p, g, state, fmt, step=step, num_threads=threads, simd=path, **HYPER)
        results.append((p, state))
    (p1, s1), (p2, s2) = results
    assert_same_bits(p2, p1, "param")
    for key in s1:
        assert_same_bits(s2[key], s1[key], key)


@pytest.mark.parametrize("grad_dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("path", PATHS)
def test_8bit_zero_nan_infinite_huge_and_tiny_blocks_equal_reference(path, grad_dtype):
    n = 6 * Q8_BLOCK_ELEMS + 37
    gen = torch.Generator().manual_seed(3)
    blocks = [slice(k * Q8_BLOCK_ELEMS, (k + 1) * Q8_BLOCK_ELEMS) for k in range(7)]
    state = zero_state("8bit", n)
    state["exp_avg"][blocks[5].start :] = 0x42
    state["exp_avg_sq"][blocks[5].start :] = 0xF0
    state["exp_avg_scale"][5:] = 1e-3
    state["exp_avg_sq_scale"][5:] = 1e-6
    g = torch.randn(n, generator=gen)
    g[blocks[0]] = 0.0  # zero state, zero grad: scale 0
    # v near 1e33 beside v from 1e22 to 1e25: exp_avg_sq's subnormal codes, exp_avg's too (m near 1e12)
    g[blocks[1]][::2] = 1e18
    g[blocks[1]][1::2] = 1e13 * torch.empty(Q8_BLOCK_ELEMS // 2).uniform_(0.3, 3, generator=gen)
    g[blocks[1]][1] = 1e-20  # far below every code point: exp_avg_sq takes code 1, never 0
    g[blocks[2]][7] = float("nan")  # the whole block decodes to NaN from here on
    g[blocks[3]][100] = float("inf")
    g[blocks[4]] = 1e-25  # v underflows to float32 subnormals: stored as zeros with scale 0
    g[blocks[5]] *= 1e-30  # tiny grads against an older, larger state
    state["exp_avg_scale"][6] = 0.0  # the short last block: exp_avg stays zero, exp_avg_sq decays
    g[blocks[6]] = 0.0
    g = g.to(grad_dtype)
    run_both(path, "8bit", n, grad_dtype, torch.bfloat16, state=state, grad_list=[g, g * 0.5, g * 2])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", PATHS)
def test_bf16_grad_equals_fp32_grad_of_the_same_values_bitwise(path, fmt):
    """Adam fed bf16 gradients gives exactly what it gives fed their fp32 promotion (issue 16)."""
    n = 8 * Q8_BLOCK_ELEMS + 37
    out = []
    for promote in (False, True):
        p, state = torch.randn(n, generator=torch.Generator().manual_seed(9)), stored_state(fmt, n, 9)
        copy = torch.empty(n, dtype=torch.bfloat16)
        for step, g in enumerate(grads(n, 4, torch.bfloat16, 10), start=1):
            native_step(p, g.float() if promote else g, state, fmt, step=step, out_copy=copy, grad_scale=0.5,
                        simd=path, **HYPER)  # fmt: skip
        out.append((p, state, copy))
    (p16, s16, c16), (p32, s32, c32) = out
    assert_same_bits(p16, p32, "param")
    assert_same_bits(c16, c32, "copy")
    for key in s16:
        assert_same_bits(s16[key], s32[key], key)


@pytest.mark.parametrize("path", PATHS)
def test_bf16_exp_avg_sq_keeps_its_small_updates(path):
    """At beta2 = 0.999 each step moves exp_avg_sq by 0.1%, under bf16's half ulp: rounded to nearest it
    would freeze near 0.4 with a constant gradient of 1; rounded stochastically it tracks 1 - 0.999^t."""
    n, steps = 4096, 2000
    p, g = torch.zeros(n), torch.ones(n)
    state = zero_state("bf16", n)
    hyper = {**HYPER, "lr": 0.0, "weight_decay": 0.0}
    for step in range(1, steps + 1):
        native_step(p, g, state, "bf16", step=step, simd=path, **hyper)
    expected = 1 - 0.999**steps  # 0.8648
    assert state["exp_avg_sq"].float().mean().item() == pytest.approx(expected, rel=0.01)
    assert state["exp_avg"].float().mean().item() == pytest.approx(1.0, rel=0.01)


# ---------------------------------------------------------------- the optimizers


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = ((64, 33), (33,), (7,), (3, Q8_BLOCK_ELEMS + 1))
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]


def _train(opt, params, first_step: int, steps: int) -> None:
    for step in range(first_step, first_step + steps):
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-2
        opt.step()


@pytest.mark.parametrize("fmt", FORMATS)
def test_optimizer_steps_each_param_like_the_reference(fmt):
    params, ref = _params(), [p.detach().clone().flatten() for p in _params()]
    opt = CPUAdamW(params, lr=1e-2, weight_decay=0.1, moments=fmt)
    ref_states = [zero_state(fmt, p.numel()) for p in ref]
    for step in range(1, 6):
        _train(opt, params, step, 1)
        for p, rp, rstate in zip(params, ref, ref_states, strict=True):
            stored_moments_step(rp, p.grad.flatten(), rstate, fmt, step=step, **HYPER)
    for p, rp, rstate in zip(params, ref, ref_states, strict=True):
        assert_same_bits(p.detach().flatten(), rp, "param")
        state = opt.state[p]
        assert state["exp_avg"].shape == p.shape and state["exp_avg"].dtype == moment_format(fmt).code_dtype
        for key, value in rstate.items():
            assert_same_bits(state[key].flatten(), value, key)


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_saved_and_loaded_continues_training_exactly(fmt):
    straight, start, end = _params(), _params(), _params()
    straight_opt = CPUAdamW(straight, moments=fmt)
    _train(straight_opt, straight, 0, 10)
    first = CPUAdamW(start, moments=fmt)
    _train(first, start, 0, 5)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()))
    scales = {"exp_avg_scale", "exp_avg_sq_scale"} if fmt == "8bit" else set()
    assert set(saved["state"][3]) == {"step", "exp_avg", "exp_avg_sq"} | scales
    for p, q in zip(end, start, strict=True):
        p.data.copy_(q.detach())
    second = CPUAdamW(end, moments=fmt)
    second.load_state_dict(saved)
    _train(second, end, 5, 5)
    for a, b in zip(end, straight, strict=True):
        assert_same_bits(a.detach(), b.detach(), "param")
        for key, value in straight_opt.state[b].items():
            assert_same_bits(second.state[a][key], value, key)


@pytest.mark.parametrize("source, target", [("fp32", "8bit"), ("8bit", "fp32"), ("bf16", "8bit"), ("8bit", "bf16")])
def test_loading_another_formats_state_converts_it(source, target):
    params = _params()
    first = CPUAdamW(params, moments=source)
    _train(first, params, 0, 3)
    second = CPUAdamW(_params(), moments=target)
    second.load_state_dict(first.state_dict())
    for p, q in zip(params, second.param_groups[0]["params"], strict=True):
        old, new = first.state[p], second.state[q]
        for name in ("exp_avg", "exp_avg_sq"):
            value = decode(old[name], old.get(SCALE_NAMES[name]), source, name)
            codes, scale = encode(value, target, name)
            assert_same_bits(new[name].flatten(), codes, name)
            assert new[name].shape == q.shape
            if scale is not None:
                assert_same_bits(new[SCALE_NAMES[name]], scale, SCALE_NAMES[name])
            else:
                assert SCALE_NAMES[name] not in new
        assert new["step"].item() == 3


def test_torch_adamw_state_loads_into_8bit_moments():
    params = _params()
    ref = torch.optim.AdamW(params, foreach=False)
    _train(ref, params, 0, 2)
    opt = CPUAdamW(_params(), moments="8bit")
    opt.load_state_dict(ref.state_dict())
    p = opt.param_groups[0]["params"][0]
    expected, _ = encode(ref.state[params[0]]["exp_avg"], "8bit", "exp_avg")
    assert_same_bits(opt.state[p]["exp_avg"].flatten(), expected, "exp_avg")


# ---------------------------------------------------------------- bad input


def _bad_step(fmt: str, **tensors) -> None:
    n = 300
    args = {"param": torch.zeros(n), "grad": torch.ones(n), **zero_state(fmt, n)}
    args.update(tensors)
    adam_step_flat(args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"], step=1, moments=fmt,
                   exp_avg_scale=args.get("exp_avg_scale"), exp_avg_sq_scale=args.get("exp_avg_sq_scale"),
                   **HYPER)  # fmt: skip


U8 = torch.uint8
BAD = {
    "missing_scale": ("8bit", {"exp_avg_sq_scale": None}, r"moments='8bit' needs exp_avg_sq_scale \(float32, 2 "),
    "short_scale": ("8bit", {"exp_avg_scale": torch.zeros(1)}, "exp_avg_scale has 1 elements, expected 2"),
    "fp64_scale": ("8bit", {"exp_avg_scale": torch.zeros(2, dtype=torch.float64)}, "exp_avg_scale must have dtype"),
    "scale_without_8bit": ("bf16", {"exp_avg_scale": torch.zeros(2)}, "exp_avg_scale is given but moments='bf16'"),
    "fp32_moment_as_bf16": ("bf16", {"exp_avg": torch.zeros(300)}, "exp_avg must have dtype torch.bfloat16 for m"),
    "codes_as_fp32": ("fp32", {"exp_avg_sq": torch.zeros(300, dtype=U8)}, "exp_avg_sq must have dtype torch.float32"),
    "short_codes": ("8bit", {"exp_avg": torch.zeros(299, dtype=U8)}, "exp_avg has 299 elements, expected 300"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_moment_tensors_raise_naming_them(case):
    fmt, tensors, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        _bad_step(fmt, **tensors)


def test_scales_sharing_memory_with_codes_raise():
    shared = torch.zeros(300, dtype=torch.uint8)
    with pytest.raises(ValueError, match="share memory"):
        _bad_step("8bit", exp_avg=shared, exp_avg_scale=shared[:8].view(torch.float32))


def test_unknown_moments_name_lists_the_formats():
    with pytest.raises(ValueError, match="moments='fp8' is not a moment format"):
        CPUAdamW(_params(), moments="fp8")


def test_loading_a_state_with_missing_scales_names_the_param():
    opt = CPUAdamW(_params(), moments="8bit")
    _train(opt, opt.param_groups[0]["params"], 0, 1)
    saved = opt.state_dict()
    del saved["state"][2]["exp_avg_sq_scale"]
    with pytest.raises(ValueError, match=r"state\[2\] \(param 2\): 8bit exp_avg_sq needs exp_avg_sq_scale"):
        CPUAdamW(_params(), moments="8bit").load_state_dict(saved)


def test_a_pickled_copy_keeps_the_format_and_steps_like_the_original():
    import pickle

    params = _params()
    opt = CPUAdamW(params, moments="8bit", num_threads=1)
    _train(opt, params, 0, 2)
    twin_params, twin = pickle.loads(pickle.dumps((params, opt)))
    assert twin.moments.name == "8bit" and twin.num_threads == 1
    _train(opt, params, 2, 2)
    _train(twin, twin_params, 2, 2)
    for a, b in zip(params, twin_params, strict=True):
        assert_same_bits(b.detach(), a.detach(), "param")
