"""Native SIMD Adam/AdamW for fp32 CPU tensors: a flat-shard step and drop-in torch optimizers.

`adam_step_flat` is the call the engine makes on an offloaded shard; `CPUAdam` and `CPUAdamW`
wrap it as `torch.optim.Optimizer`s whose math and state_dict match `torch.optim.Adam`/`AdamW`.
Both keep the moments in fp32 (default, exact), bf16 or 8-bit (see `infinity.shards.moments`).
"""

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch

from infinity._native_loader import load_native
from infinity.optim.simd import resolve_simd
from infinity.shards.moments import MOMENT_NAMES, SCALE_NAMES, MomentFormat, decode, encode, moment_format

_GRAD_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_COPY_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _real(name: str, value: Any) -> float:
    if type(value) is float:  # the common case, checked first: this runs several times per step
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    return float(value)


def check_hyperparameters(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> tuple[float, ...]:
    """Return (lr, beta1, beta2, eps, weight_decay) as floats, or raise ValueError naming the bad one."""
    lr = _real("lr", lr)
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"lr must be finite and >= 0, got {lr}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    beta1, beta2 = (_real(f"betas[{i}]", b) for i, b in enumerate(betas))
    for i, beta in enumerate((beta1, beta2)):
        if not 0.0 <= beta < 1.0:  # also rejects NaN
            raise ValueError(f"betas[{i}] must be in [0, 1), got {beta}")
    eps = _real("eps", eps)
    if not (math.isfinite(eps) and eps > 0.0):
        raise ValueError(f"eps must be finite and > 0, got {eps}")
    weight_decay = _real("weight_decay", weight_decay)
    if not (math.isfinite(weight_decay) and weight_decay >= 0.0):
        raise ValueError(f"weight_decay must be finite and >= 0, got {weight_decay}")
    return lr, beta1, beta2, eps, weight_decay


def _check_tensor(name: str, t: Any, dtypes: Iterable[torch.dtype], numel: int | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}")
    if t.is_sparse or t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense strided tensor, got layout {t.layout}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() on it first)")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel} like param")


def _check_disjoint(named: dict[str, torch.Tensor]) -> None:
    spans = [
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name) for name, t in named.items() if t.numel() > 0
    ]
    spans.sort()
    for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:], strict=False):
        if start_b < end_a:
            raise ValueError(f"{name_a} and {name_b} share memory; each buffer must be distinct")


def _check_num_threads(num_threads: Any) -> int:
    if num_threads is None:
        return torch.get_num_threads()
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive int or None, got {num_threads!r}")
    return num_threads


def adam_step_flat(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    out_copy: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    num_threads: int | None = None,
    simd: str | None = None,
    moments: str | MomentFormat = "fp32",
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
) -> None:
    """One Adam (adamw_mode=False) or AdamW step on a flat fp32 shard, in place, in one pass.

    `step` is the 1-based step count after this update (bias correction). The grad (fp32, bf16 or
    fp16) is multiplied by `grad_scale` first; `out_copy` (bf16/fp16) receives the new weights.
    exp_avg and exp_avg_sq are stored in the `moments` format: "fp32" (float32), "bf16" (bfloat16) or
    "8bit" (uint8 codes, with float32 `exp_avg_scale` and `exp_avg_sq_scale`, one per block). bf16 and
    8bit round stochastically; the block grid and the rounding's random stream count from the shard's
    first element, so step a shard whole, always from the same first element. Runs on `num_threads`
    threads (default torch.get_num_threads()) and the `simd` path (default $INFINITY_SIMD, else the
    best this CPU has). Raises ValueError for any bad input.
    """
    fmt = moment_format(moments)
    _check_tensor("param", param, (torch.float32,), None)
    n = param.numel()
    _check_tensor("grad", grad, tuple(_GRAD_DTYPES), n)
    buffers = {"param": param, "grad": grad}
    for name, tensor, scale in (("exp_avg", exp_avg, exp_avg_scale), ("exp_avg_sq", exp_avg_sq, exp_avg_sq_scale)):
        _check_moment(name, tensor, scale, fmt, n)
        buffers[name] = tensor
        if scale is not None:
            buffers[SCALE_NAMES[name]] = scale
    if out_copy is not None:
        _check_tensor("out_copy", out_copy, tuple(_COPY_DTYPES), n)
        buffers["out_copy"] = out_copy
    _check_disjoint(buffers)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the count including this update), got {step!r}")
    lr, beta1, beta2, eps, weight_decay = check_hyperparameters(lr, (beta1, beta2), eps, weight_decay)
    grad_scale = _real("grad_scale", grad_scale)
    if not (math.isfinite(grad_scale) and grad_scale > 0.0):
        raise ValueError(f"grad_scale must be finite and > 0, got {grad_scale}")
    threads = _check_num_threads(num_threads)
    path = resolve_simd(simd)
    load_native().adam.step(
        param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        0 if out_copy is None else out_copy.data_ptr(), n,
        _GRAD_DTYPES[grad.dtype], "none" if out_copy is None else _COPY_DTYPES[out_copy.dtype],
        step, lr, beta1, beta2, eps, weight_decay, bool(adamw_mode), grad_scale, path, threads, fmt.name,
        0 if exp_avg_scale is None else exp_avg_scale.data_ptr(),
        0 if exp_avg_sq_scale is None else exp_avg_sq_scale.data_ptr(),
    )  # fmt: skip
    # The kernel wrote through raw pointers; tell autograd, as torch's in-place ops would.
    written = [t for name, t in buffers.items() if name != "grad" and not t.is_inference()]
    torch.autograd.graph.increment_version(written)


def _check_moment(name: str, t: Any, scale: Any, fmt: MomentFormat, numel: int) -> None:
    if isinstance(t, torch.Tensor) and t.dtype != fmt.code_dtype:
        raise ValueError(f"{name} must have dtype {fmt.code_dtype} for moments={fmt.name!r}, got {t.dtype} "
                         "(pass the moments format the state was made in)")  # fmt: skip
    _check_tensor(name, t, (fmt.code_dtype,), numel)
    scale_name = SCALE_NAMES[name]
    if fmt.block_elems is None:
        if scale is not None:
            raise ValueError(f"{scale_name} is given but moments={fmt.name!r} has no scales; pass None")
        return
    if scale is None:
        raise ValueError(f"moments={fmt.name!r} needs {scale_name} (float32, {fmt.num_blocks(numel)} elements)")
    _check_tensor(scale_name, scale, (torch.float32,), None)
    if scale.numel() != fmt.num_blocks(numel):
        raise ValueError(f"{scale_name} has {scale.numel()} elements, expected {fmt.num_blocks(numel)} "
                         f"(one per {fmt.block_elems} elements of param)")  # fmt: skip


class CPUAdam(torch.optim.Optimizer):
    """torch.optim.Adam (adamw_mode=False) or AdamW (adamw_mode=True) on fp32 contiguous CPU params.

    State and param_groups use torch's keys, so with fp32 moments state_dicts load into
    torch.optim.Adam/AdamW and back. Grads may be fp32, bf16 or fp16. amsgrad, maximize and
    differentiable are not supported. `num_threads` defaults to torch.get_num_threads(); `simd`
    forces a path (see resolve_simd). `moments` ("fp32", "bf16", "8bit") is how exp_avg and
    exp_avg_sq are stored (see infinity.shards.moments): shaped like the param in the format's dtype,
    plus `exp_avg_scale` and `exp_avg_sq_scale` (float32, one per block) for 8bit; the state_dict
    holds exactly these. `load_state_dict` accepts a state in any of the formats and converts it
    (rounding to nearest); to hand an 8bit state to torch, load it into a CPUAdam(moments="fp32").
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = False,
        num_threads: int | None = None,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        simd: str | None = None,
        moments: str = "fp32",
    ) -> None:
        check_hyperparameters(lr, betas, eps, weight_decay)
        self.moments = moment_format(moments)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": bool(adamw_mode),
        }
        self.num_threads = _check_num_threads(num_threads) if num_threads is not None else None
        self.simd = resolve_simd(simd) if simd is not None else None
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, plus `adamw_mode` as an alias of `decoupled_weight_decay`, validated early."""
        if "adamw_mode" in param_group:
            param_group = dict(param_group)
            param_group["decoupled_weight_decay"] = bool(param_group.pop("adamw_mode"))
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_group(group, len(self.param_groups) - 1)
        for i, p in enumerate(group["params"]):
            _check_tensor(f"param_groups[{len(self.param_groups) - 1}]['params'][{i}]", p, (torch.float32,), None)

    def __getstate__(self) -> dict[str, Any]:
        """torch's pickled state plus our own settings (a copy steps like the original)."""
        return {**super().__getstate__(), "num_threads": self.num_threads, "simd": self.simd,
                "moments": self.moments.name}  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickling brings our settings; torch's load_state_dict calls this too, without them.
        state = dict(state)
        for key, default in (("num_threads", None), ("simd", None), ("moments", "fp32")):
            if key in state or not hasattr(self, key):
                setattr(self, key, state.pop(key, default))
        self.moments = moment_format(self.moments)
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in (("amsgrad", False), ("maximize", False), ("foreach", None),
                               ("capturable", False), ("differentiable", False), ("fused", None),
                               ("decoupled_weight_decay", False)):  # fmt: skip
                group.setdefault(key, value)
            for p in group["params"]:
                p_state = self.state.get(p, {})
                if p_state and not torch.is_tensor(p_state["step"]):
                    p_state["step"] = torch.tensor(float(p_state["step"]), dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Update every param that has a grad, each with its own step count; return closure()'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            _check_group(group, index)
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state.update(self._zero_moments(p))
                step = int(state["step"].item()) + 1
                adam_step_flat(
                    p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                    step=step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], adamw_mode=group["decoupled_weight_decay"],
                    num_threads=self.num_threads, simd=self.simd, moments=self.moments,
                    exp_avg_scale=state.get("exp_avg_scale"), exp_avg_sq_scale=state.get("exp_avg_sq_scale"),
                )  # fmt: skip
                state["step"] += 1
        return loss

    def _zero_moments(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        fmt = self.moments
        out = {name: torch.zeros_like(p, dtype=fmt.code_dtype, memory_format=torch.preserve_format)
               for name in MOMENT_NAMES}  # fmt: skip
        if fmt.block_elems is not None:
            out.update({SCALE_NAMES[name]: torch.zeros(fmt.num_blocks(p.numel())) for name in MOMENT_NAMES})
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, then each param's moments converted from the format they were saved in to ours."""
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        saved_states = state_dict["state"]
        super().load_state_dict(state_dict)  # casts every float state tensor to float32; redone below
        params = [p for group in self.param_groups for p in group["params"]]
        for index, (saved_id, p) in enumerate(zip(saved_ids, params, strict=True)):
            saved = saved_states.get(saved_id)
            if saved and "exp_avg" in saved:
                state = self.state[p]
                for name in SCALE_NAMES.values():
                    state.pop(name, None)
                state.update(_moments_in(self.moments, saved, p, f"state[{saved_id}] (param {index})"))


def _saved_format(saved: dict[str, Any], where: str) -> MomentFormat:
    dtype = saved["exp_avg"].dtype if isinstance(saved["exp_avg"], torch.Tensor) else None
    by_dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.uint8: "8bit"}
    if dtype not in by_dtype:
        raise ValueError(f"{where}: exp_avg has dtype {dtype}; a saved moment is float32, bfloat16 or uint8 (8bit)")
    return moment_format(by_dtype[dtype])


def _describe(t: Any) -> str:
    return f"{t.dtype} tensor of {t.numel()} elements" if isinstance(t, torch.Tensor) else type(t).__name__


def _moments_in(fmt: MomentFormat, saved: dict[str, Any], p: torch.Tensor, where: str) -> dict[str, torch.Tensor]:
    """The saved moments of param p, checked and converted to `fmt` (copies on the CPU, shaped like p)."""
    source = _saved_format(saved, where)
    out = {}
    for name in MOMENT_NAMES:
        codes, scale = saved.get(name), saved.get(SCALE_NAMES[name])
        if not isinstance(codes, torch.Tensor) or codes.dtype != source.code_dtype or codes.numel() != p.numel():
            raise ValueError(f"{where}: {name} must be a {source.code_dtype} tensor of {p.numel()} elements "
                             f"like exp_avg, got {_describe(codes)}")  # fmt: skip
        if source.block_elems is not None:
            blocks = source.num_blocks(p.numel())
            if not isinstance(scale, torch.Tensor) or scale.numel() != blocks:
                raise ValueError(f"{where}: 8bit {name} needs {SCALE_NAMES[name]} with {blocks} elements, "
                                 f"got {_describe(scale)}")  # fmt: skip
            scale = scale.detach().to("cpu", torch.float32).flatten()
        codes = codes.detach().to("cpu").flatten()
        if source == fmt:
            new_codes, new_scale = codes.clone(), None if scale is None else scale.clone()
        else:
            new_codes, new_scale = encode(decode(codes, scale, source, name), fmt, name)
        out[name] = new_codes.view(p.shape)
        if new_scale is not None:
            out[SCALE_NAMES[name]] = new_scale
    return out


class CPUAdamW(CPUAdam):
    """torch.optim.AdamW on fp32 CPU params, natively: CPUAdam with decoupled weight decay (default 1e-2)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        num_threads: int | None = None,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        simd: str | None = None,
        moments: str = "fp32",
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, True, num_threads,
                         amsgrad=amsgrad, maximize=maximize, simd=simd, moments=moments)  # fmt: skip

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As CPUAdam's, but decoupled weight decay always, as torch.optim.AdamW forces it."""
        param_group = {k: v for k, v in param_group.items() if k != "adamw_mode"}
        param_group["decoupled_weight_decay"] = True
        super().add_param_group(param_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True


def _check_group(group: dict[str, Any], index: int) -> None:
    for flag, why in (("amsgrad", "AMSGrad is not implemented by the native kernel"),
                      ("maximize", "negate the loss instead"),
                      ("differentiable", "the native step is not differentiable")):  # fmt: skip
        if group.get(flag):
            raise ValueError(f"param_groups[{index}]: {flag}=True is not supported ({why})")
    try:
        check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    except ValueError as exc:
        raise ValueError(f"param_groups[{index}]: {exc}") from None
