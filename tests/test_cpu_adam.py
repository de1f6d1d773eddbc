"""Specification of the native CPU Adam/AdamW: torch's math, torch's state_dict, every SIMD path.

Two references. (1) torch's single-tensor Adam formula run op for op with torch's own CPU kernels
but a correctly rounded sqrt (numpy's; `infinity.optim.adam_reference`): the native kernel must
equal it bit for bit, on every path.
(2) torch.optim.Adam/AdamW themselves: they differ from (1) only in sqrt, because torch's CPU
sqrt (MKL VML) is off by one ulp for about a fifth of the inputs, so they get a tolerance (below).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infinity._native_loader import load_native
from infinity.optim import CPUAdam, CPUAdamW, adam_step_flat, simd, supported_paths
from infinity.optim.adam_reference import adam_formula_step as reference_step

NATIVE = load_native()  # a missing native build fails the whole file; it never skips
PATHS = supported_paths()
LENGTHS = (1, 7, 15, 17, 1023, 1_000_003)
MODES = {  # name: (adamw_mode, weight_decay)
    "adamw": (True, 0.1),
    "adam_l2": (False, 0.1),
    "no_decay": (False, 0.0),
}
LR = 1e-2


def steps_for(n: int) -> int:
    return 3 if n > 100_000 else 20


def torch_tolerance(steps: int, lr: float) -> dict[str, float]:
    """Tolerance against torch.optim, whose sqrt differs from IEEE sqrt by <= 1 ulp.

    A denominator one ulp off changes the update by <= 2^-23 relative and may flip the rounding
    of p; those flips and the update differences accumulate over the steps. Measured over 20 steps
    on 1e6 elements (lr 1e-3 and 1e-2, AdamW, Adam+L2, Adam): max |dp| beyond 2^-22*|p| was
    6.0e-8 for lr=1e-2 and 1.6e-9 for lr=1e-3, so rtol = 2 ulps (2^-22) and atol = steps*lr*2^-20
    (1.9e-7 and 1.9e-8 at 20 steps) hold with a 3x margin. exp_avg/exp_avg_sq get the same bound;
    they are bitwise equal whenever they do not depend on p (AdamW, or no decay).
    """
    return {"rtol": 2.0**-22, "atol": steps * lr * 2.0**-20}


def random_state(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)


def random_grads(n: int, steps: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> list[torch.Tensor]:
    """Grads spanning 10 decades, so fp16 ones include subnormals and bf16 ones many exponents."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        scale = 10.0 ** torch.empty(n).uniform_(-7, 2, generator=gen)
        out.append((torch.randn(n, generator=gen) * scale).to(dtype))
    return out


def flat_kwargs(mode: str, lr: float = LR) -> dict:
    adamw_mode, weight_decay = MODES[mode]
    return {"lr": lr, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": weight_decay,
            "adamw_mode": adamw_mode}  # fmt: skip


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    a, e = actual.view(torch.int32 if actual.dtype == torch.float32 else torch.int16), expected
    e = e.view(a.dtype)
    bad = (a != e).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.numel()} elements differ, first at {bad[0].item()}"


# ---------------------------------------------------------------- the math, every path


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("path", PATHS)
def test_step_equals_torch_formula_bitwise(path, n, mode):
    p, m, v = random_state(n)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    kw = flat_kwargs(mode)
    for step, g in enumerate(random_grads(n, steps_for(n)), start=1):
        adam_step_flat(p, g, m, v, step=step, simd=path, **kw)
        reference_step(rp, g, rm, rv, step=step, **kw)
    assert_bitwise(p, rp, "param")
    assert_bitwise(m, rm, "exp_avg")
    assert_bitwise(v, rv, "exp_avg_sq")


@pytest.mark.parametrize("beta1", (0.0, 0.3, 0.5))
@pytest.mark.parametrize("path", PATHS)
def test_beta1_at_most_half_takes_torchs_other_lerp_branch_bitwise(path, beta1):
    n = 1023
    p, m, v = random_state(n)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    kw = {**flat_kwargs("adamw"), "beta1": beta1, "beta2": 0.9}
    for step, g in enumerate(random_grads(n, 10), start=1):
        adam_step_flat(p, g, m, v, step=step, simd=path, **kw)
        reference_step(rp, g, rm, rv, step=step, **kw)
    assert_bitwise(m, rm, "exp_avg")
    assert_bitwise(p, rp, "param")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("path", PATHS)
def test_step_matches_torch_optimizer(path, n, mode):
    adamw_mode, weight_decay = MODES[mode]
    p, m, v = random_state(n)
    ref = torch.nn.Parameter(p.clone())
    opt_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    opt = opt_cls([ref], lr=LR, weight_decay=weight_decay, foreach=False)
    steps = steps_for(n)
    for step, g in enumerate(random_grads(n, steps), start=1):
        adam_step_flat(p, g, m, v, step=step, simd=path, **flat_kwargs(mode))
        ref.grad = g.clone()
        opt.step()
    tol = torch_tolerance(steps, LR)
    torch.testing.assert_close(p, ref.detach(), **tol)
    torch.testing.assert_close(m, opt.state[ref]["exp_avg"], **tol)
    torch.testing.assert_close(v, opt.state[ref]["exp_avg_sq"], **tol)
    if mode != "adam_l2":  # moments independent of p: no sqrt in their history
        assert_bitwise(m, opt.state[ref]["exp_avg"], "exp_avg")
        assert_bitwise(v, opt.state[ref]["exp_avg_sq"], "exp_avg_sq")


@pytest.mark.parametrize("n", (17, 1023, 1_000_003))
@pytest.mark.parametrize("grad_dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("path", PATHS)
def test_low_precision_grads_match_torch_fed_their_float_value(path, grad_dtype, n):
    p, m, v = random_state(n)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=LR, weight_decay=0.1, foreach=False)
    steps = steps_for(n)
    for step, g in enumerate(random_grads(n, steps, grad_dtype), start=1):
        adam_step_flat(p, g, m, v, step=step, simd=path, **flat_kwargs("adamw"))
        reference_step(rp, g.float(), rm, rv, step=step, **flat_kwargs("adamw"))
        ref.grad = g.float()
        opt.step()
    assert_bitwise(p, rp, "param vs formula")
    assert_bitwise(m, rm, "exp_avg vs formula")
    torch.testing.assert_close(p, ref.detach(), **torch_tolerance(steps, LR))


@pytest.mark.parametrize("n", (17, 1023, 100_003))
@pytest.mark.parametrize("grad_scale", (1.0, 0.37))
@pytest.mark.parametrize("grad_dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("path", PATHS)
def test_16_bit_grads_step_bit_for_bit_like_their_fp32_promotion(path, grad_dtype, grad_scale, n):
    """What the engine relies on when gradients cross from the GPU in the compute dtype: the kernel fed the
    16-bit gradient gives exactly what it gives fed the same values promoted to fp32 (and the same copy-out)."""
    low = (random_state(n)[0], torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16))
    promoted = tuple(t.clone() for t in low)
    for step, g in enumerate(random_grads(n, 4, grad_dtype), start=1):
        for (p, m, v, out), grad in ((low, g), (promoted, g.float())):
            adam_step_flat(
                p, grad, m, v, step=step, grad_scale=grad_scale, out_copy=out, simd=path, **flat_kwargs("adamw")
            )
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "copy-out"), low, promoted, strict=True):
        assert_bitwise(a, b, name)


@pytest.mark.parametrize("grad_dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("path", PATHS)
def test_every_16_bit_grad_value_converts_like_torch(path, grad_dtype):
    g = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(grad_dtype)
    p, m, v = random_state(g.numel())
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    adam_step_flat(p, g, m, v, step=1, simd=path, **flat_kwargs("adam_l2"))
    reference_step(rp, g.float(), rm, rv, step=1, **flat_kwargs("adam_l2"))
    finite = torch.isfinite(g.float())
    assert_bitwise(m[finite], rm[finite], "exp_avg")
    assert_bitwise(p[finite], rp[finite], "param")
    assert torch.isnan(p[~finite]).all() and torch.isnan(rp[~finite]).all()


@pytest.mark.parametrize("path", PATHS)
def test_grad_scale_multiplies_the_grad_inside_the_pass(path):
    n, scale = 1023, 1.0 / 1024.0 * 0.7
    p, m, v = random_state(n)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    for step, g in enumerate(random_grads(n, 5, torch.float16), start=1):
        adam_step_flat(p, g, m, v, step=step, grad_scale=scale, simd=path, **flat_kwargs("adamw"))
        reference_step(rp, g, rm, rv, step=step, grad_scale=scale, **flat_kwargs("adamw"))
    assert_bitwise(p, rp, "param")
    assert_bitwise(v, rv, "exp_avg_sq")


@pytest.mark.parametrize("n", (1, 17, 1023, 1_000_003))
@pytest.mark.parametrize("copy_dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("path", PATHS)
def test_copy_out_equals_torch_cast_of_new_weights(path, copy_dtype, n):
    p, m, v = random_state(n)
    copy = torch.empty(n, dtype=copy_dtype)
    for step, g in enumerate(random_grads(n, 2), start=1):
        adam_step_flat(p, g, m, v, step=step, out_copy=copy, simd=path, **flat_kwargs("adamw"))
        assert_bitwise(copy, p.to(copy_dtype), f"copy after step {step}")


@pytest.mark.parametrize("copy_dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("path", PATHS)
def test_copy_out_rounds_every_kind_of_float_like_torch(path, copy_dtype):
    """Random bit patterns plus ties, overflow edges, subnormals, infinities and NaNs, with lr=0."""
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=gen, dtype=torch.int64)
    special = [0x3F808000, 0x3F818000, 0x3F800001, 0x477FEFFF, 0x477FF000, 0x7F7FFFFF, 0x33000000,
               0x33000001, 0x387FE000, 0x387FF000, 0x00000001, 0x807FFFFF, 0x7F800000, 0xFF800000,
               0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF, 0x80000000]  # fmt: skip
    bits = torch.cat([bits, torch.tensor(special, dtype=torch.int64)])
    p = bits.to(torch.int32).view(torch.float32).clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    copy = torch.empty(p.numel(), dtype=copy_dtype)
    kw = flat_kwargs("no_decay", lr=0.0)
    adam_step_flat(p, torch.zeros_like(p), m, v, step=1, out_copy=copy, simd=path, **kw)
    assert_bitwise(copy, p.to(copy_dtype), "copy")


@pytest.mark.parametrize("path", PATHS)
def test_results_identical_for_one_and_two_threads(path):
    runs = []
    for threads in (1, 2):
        p, m, v = random_state(1_000_003)
        copy = torch.empty(p.numel(), dtype=torch.bfloat16)
        for step, g in enumerate(random_grads(p.numel(), 2), start=1):
            adam_step_flat(p, g, m, v, step=step, out_copy=copy, num_threads=threads, simd=path,
                           **flat_kwargs("adamw"))  # fmt: skip
        runs.append((p, m, v, copy))
    for name, one, two in zip(("param", "exp_avg", "exp_avg_sq", "copy"), *runs, strict=True):
        assert_bitwise(two, one, name)


@pytest.mark.parametrize("path", PATHS)
def test_empty_shard_is_a_no_op(path):
    """A zero-length shard (the empty slice at a flat's end) steps nothing: the memory around it, where an
    off-by-one read-modify-write would land, keeps every bit."""
    names = ("param", "grad", "exp_avg", "exp_avg_sq", "copy")
    buffers = [torch.randn(8) for _ in range(4)] + [torch.randn(8).to(torch.bfloat16)]
    before = [b.clone() for b in buffers]
    p, g, m, v, copy = (b[4:4] for b in buffers)
    adam_step_flat(p, g, m, v, step=1, out_copy=copy, num_threads=2, simd=path, **flat_kwargs("adamw"))
    for name, after, was in zip(names, buffers, before, strict=True):
        assert_bitwise(after, was, name)


def test_step_bumps_autograd_version_counters():
    p, m, v = random_state(8)
    before = (p._version, m._version, v._version)
    adam_step_flat(p, torch.ones(8), m, v, step=1, **flat_kwargs("adamw"))
    assert all(after > b for after, b in zip((p._version, m._version, v._version), before, strict=True))


# ---------------------------------------------------------------- choosing the path


def test_default_path_is_the_best_the_cpu_supports(monkeypatch):
    monkeypatch.delenv(simd.SIMD_ENV_VAR, raising=False)
    assert simd.resolve_simd() == PATHS[0]
    assert PATHS[-1] == "scalar"


def test_forcing_a_path_the_cpu_lacks_raises(monkeypatch):
    monkeypatch.setattr(simd, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    with pytest.raises(ValueError, match="avx512.*not supported by this CPU"):
        simd.resolve_simd("avx512")
    monkeypatch.setenv(simd.SIMD_ENV_VAR, "avx512")
    with pytest.raises(ValueError, match="INFINITY_SIMD"):
        simd.resolve_simd()
    assert simd.resolve_simd("avx2") == "avx2"


def test_cpu_flags_come_from_proc_cpuinfo_and_choose_the_paths_py_cpuinfo_would(tmp_path):
    """/proc/cpuinfo is read in microseconds where py-cpuinfo takes a second (paid inside the first step);
    the flags the paths need are spelled alike in both."""
    listing = tmp_path / "cpuinfo"
    listing.write_text(
        "processor\t: 0\nmodel name\t: x\nflags\t\t: fpu avx2 fma f16c\n\nprocessor\t: 1\nflags\t: sse\n"
    )
    assert simd._proc_cpuinfo_flags(listing) == frozenset({"fpu", "avx2", "fma", "f16c"})
    assert simd._proc_cpuinfo_flags(tmp_path / "missing") is None
    listing.write_text("processor\t: 0\nFeatures\t: fp asimd\n")  # an Arm listing: no "flags" line
    assert simd._proc_cpuinfo_flags(listing) is None
    if not Path("/proc/cpuinfo").is_file():
        pytest.skip("no /proc/cpuinfo on this system")
    import cpuinfo

    theirs = frozenset(cpuinfo.get_cpu_info().get("flags", ()))
    needed = frozenset().union(*simd._REQUIRED_FLAGS.values())
    assert simd.cpu_flags() & needed == theirs & needed


def _run_with_env(value: str) -> subprocess.CompletedProcess:
    code = (
        "import torch\n"
        "from infinity.optim import adam_step_flat, resolve_simd\n"
        "print(resolve_simd())\n"
        "t = [torch.zeros(33) for _ in range(4)]\n"
        "adam_step_flat(*t, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)\n"
    )
    env = dict(os.environ, INFINITY_SIMD=value)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("path", PATHS)
def test_env_var_forces_the_path(path):
    result = _run_with_env(path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [path]


def test_env_var_with_an_unknown_path_raises():
    result = _run_with_env("sse9")
    assert result.returncode != 0
    assert "ValueError" in result.stderr and "INFINITY_SIMD='sse9'" in result.stderr


# ---------------------------------------------------------------- the optimizers


def _model_params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((64, 33), (33,), (7,), (1,))]


def _clone(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _set_grads(param_lists, step: int, dtype: torch.dtype = torch.float32) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in param_lists[0]]
    for params in param_lists:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()


def _groups(params, adamw: bool) -> list[dict]:
    return [
        {"params": params[:2], "lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05},
        {"params": params[2:], "lr": 1e-2, "betas": (0.5, 0.9), "eps": 1e-8, "weight_decay": 0.0 if adamw else 0.2},
    ]


@pytest.mark.parametrize("adamw", (True, False))
def test_param_groups_with_their_own_hyperparameters_match_torch(adamw):
    ours, theirs = _model_params(), _model_params()
    opt = (CPUAdamW if adamw else CPUAdam)(_groups(ours, adamw))
    ref = (torch.optim.AdamW if adamw else torch.optim.Adam)(_groups(theirs, adamw), foreach=False)
    steps = 20
    for step in range(steps):
        _set_grads([ours, theirs], step)
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **torch_tolerance(steps, 1e-2))
    assert opt.state[ours[0]]["step"].item() == steps


@pytest.mark.parametrize("grad_dtype", (torch.bfloat16, torch.float16))
def test_optimizer_accepts_low_precision_grads(grad_dtype):
    ours, theirs = _model_params(), _model_params()
    for p in ours:
        p.grad_dtype = None  # torch >= 2.9 otherwise insists a grad has its param's dtype
    opt, ref = CPUAdamW(ours, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    for step in range(5):
        _set_grads([ours], step, grad_dtype)
        for p, q in zip(ours, theirs, strict=True):
            q.grad = p.grad.float()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **torch_tolerance(5, 1e-2))


def test_defaults_and_state_dict_layout_are_torchs():
    assert CPUAdam(_model_params()).defaults == torch.optim.Adam(_model_params()).defaults
    assert CPUAdamW(_model_params()).defaults == torch.optim.AdamW(_model_params()).defaults
    ours, theirs = _model_params(), _model_params()
    opt, ref = CPUAdamW(ours), torch.optim.AdamW(theirs)
    _set_grads([ours, theirs], 0)
    opt.step()
    ref.step()
    a, b = opt.state_dict(), ref.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for i, state in b["state"].items():
        assert a["state"][i].keys() == state.keys()
        assert a["state"][i]["step"].dtype == torch.float32 and a["state"][i]["step"].dim() == 0


def _train(opt, params, first_step: int, steps: int) -> None:
    for step in range(first_step, first_step + steps):
        _set_grads([params], step)
        opt.step()


@pytest.mark.parametrize("direction", ("torch_to_infinity", "infinity_to_torch"))
def test_state_dict_round_trip_through_torch_continues_training(direction):
    start, end, straight = _model_params(), _model_params(), _model_params()
    ref = torch.optim.AdamW(_groups(straight, True), foreach=False)
    _train(ref, straight, 0, 20)
    first_cls, second_cls = (
        (torch.optim.AdamW, CPUAdamW) if direction == "torch_to_infinity" else (CPUAdamW, torch.optim.AdamW)
    )
    first = first_cls(_groups(start, True))
    _train(first, start, 0, 10)
    for p, q in zip(end, start, strict=True):
        p.data.copy_(q.detach())
    second = second_cls(_groups(end, True))
    second.load_state_dict(first.state_dict())
    _train(second, end, 10, 10)
    for a, b in zip(end, straight, strict=True):
        torch.testing.assert_close(a, b, **torch_tolerance(20, 1e-2))
    assert second.state_dict()["state"][0]["step"].item() == 20


def test_loading_torch_adam_state_into_cpuadamw_keeps_decoupled_decay():
    params = _model_params()
    ref = torch.optim.Adam(params, weight_decay=0.1)
    _train(ref, params, 0, 1)
    opt = CPUAdamW(_model_params())
    opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["decoupled_weight_decay"] is True


def test_adamw_mode_alias_in_a_param_group():
    params = _model_params()
    opt = CPUAdam([{"params": params[:1], "adamw_mode": True}, {"params": params[1:]}], weight_decay=0.1)
    assert [g["decoupled_weight_decay"] for g in opt.param_groups] == [True, False]
    assert "adamw_mode" not in opt.param_groups[0]


def test_step_returns_closure_loss():
    params = _model_params()
    opt = CPUAdamW(params)

    def closure():
        opt.zero_grad()
        loss = sum((p**2).sum() for p in params)
        loss.backward()
        return loss

    assert torch.is_tensor(opt.step(closure))
    assert opt.state[params[0]]["step"].item() == 1


# ---------------------------------------------------------------- bad input, one per kind


def _good(n: int = 16) -> dict:
    return {"param": torch.zeros(n), "grad": torch.ones(n), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}


def _step(**overrides) -> None:
    args = _good()
    args.update({k: overrides.pop(k) for k in list(overrides) if k in args})
    kw = {"step": 1, **flat_kwargs("adamw"), **overrides}
    adam_step_flat(args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"], **kw)


BAD_TENSORS = {
    "non_contiguous_param": ({"param": torch.zeros(32)[::2]}, "param must be contiguous"),
    "fp16_param": ({"param": torch.zeros(16, dtype=torch.float16)}, "param must have dtype"),
    "int_grad": ({"grad": torch.ones(16, dtype=torch.int32)}, "grad must have dtype"),
    "bf16_exp_avg": ({"exp_avg": torch.zeros(16, dtype=torch.bfloat16)}, "exp_avg must have dtype"),
    "short_exp_avg_sq": ({"exp_avg_sq": torch.zeros(15)}, "exp_avg_sq has 15 elements"),
    "non_cpu_grad": ({"grad": torch.ones(16, device="meta")}, "grad must be on the CPU"),
    "not_a_tensor": ({"exp_avg": [0.0] * 16}, "exp_avg must be a torch.Tensor"),
    "fp32_out_copy": ({"out_copy": torch.zeros(16)}, "out_copy must have dtype"),
    "short_out_copy": ({"out_copy": torch.zeros(8, dtype=torch.bfloat16)}, "out_copy has 8 elements"),
}


@pytest.mark.parametrize("case", BAD_TENSORS)
def test_bad_tensor_raises_value_error_naming_it(case):
    overrides, message = BAD_TENSORS[case]
    with pytest.raises(ValueError, match=message):
        _step(**overrides)


def test_aliased_buffers_raise():
    shared = torch.zeros(16)
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq share memory"):
        _step(exp_avg=shared, exp_avg_sq=shared)
    whole = torch.zeros(32)
    with pytest.raises(ValueError, match="share memory"):
        _step(param=whole[:16], grad=whole[8:24])


BAD_SCALARS = {
    "nan_lr": ({"lr": float("nan")}, "lr must be finite"),
    "negative_lr": ({"lr": -1e-3}, "lr must be finite and >= 0"),
    "beta1_one": ({"beta1": 1.0}, r"betas\[0\] must be in \[0, 1\)"),
    "beta2_negative": ({"beta2": -0.1}, r"betas\[1\] must be in \[0, 1\)"),
    "beta2_nan": ({"beta2": float("nan")}, r"betas\[1\] must be in \[0, 1\)"),
    "zero_eps": ({"eps": 0.0}, "eps must be finite and > 0"),
    "nan_eps": ({"eps": float("nan")}, "eps must be finite and > 0"),
    "nan_weight_decay": ({"weight_decay": float("nan")}, "weight_decay must be finite"),
    "negative_weight_decay": ({"weight_decay": -0.1}, "weight_decay must be finite and >= 0"),
    "inf_grad_scale": ({"grad_scale": float("inf")}, "grad_scale must be finite and > 0"),
    "zero_step": ({"step": 0}, "step must be an int >= 1"),
    "float_step": ({"step": 1.5}, "step must be an int >= 1"),
    "string_lr": ({"lr": "0.1"}, "lr must be a real number"),
    "zero_threads": ({"num_threads": 0}, "num_threads must be a positive int"),
    "unknown_simd": ({"simd": "neon"}, "simd='neon' is not a SIMD path"),
}


@pytest.mark.parametrize("case", BAD_SCALARS)
def test_bad_hyperparameter_raises_value_error_naming_it(case):
    overrides, message = BAD_SCALARS[case]
    with pytest.raises(ValueError, match=message):
        _step(**overrides)


def test_native_entry_point_validates_scalars_too():
    t = [torch.zeros(4) for _ in range(4)]
    ptrs = [x.data_ptr() for x in t]
    with pytest.raises(ValueError, match="lr must be finite"):
        NATIVE.adam.step(*ptrs, 0, 4, "float32", "none", 1, float("nan"), 0.9, 0.999, 1e-8, 0.0, True, 1.0,
                         "scalar", 1)  # fmt: skip
    with pytest.raises(ValueError, match="unsupported dtype"):
        NATIVE.adam.step(*ptrs, 0, 4, "int8", "none", 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1.0, "scalar", 1)


@pytest.mark.parametrize("flag", ("amsgrad", "maximize"))
def test_unsupported_variants_raise(flag):
    with pytest.raises(ValueError, match=f"{flag}=True is not supported"):
        CPUAdamW(_model_params(), **{flag: True})


def test_optimizer_rejects_bad_params_and_hyperparameters():
    with pytest.raises(ValueError, match="must have dtype"):
        CPUAdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="betas"):
        CPUAdamW(_model_params(), betas=(0.9, 1.0))
    opt = CPUAdamW(_model_params())
    opt.param_groups[0]["lr"] = float("nan")
    _set_grads([opt.param_groups[0]["params"]], 0)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: lr must be finite"):
        opt.step()
