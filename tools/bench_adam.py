"""Benchmarks infinity's native CPU AdamW against torch (foreach, fused) and DeepSpeedCPUAdam.

Every contender steps its own buffers of the same size, in one process. The steps are
interleaved: each round times one step of every contender (in a rotating order), so load from
other processes falls on all of them alike; each figure is the median over the timed rounds, after
warm-up rounds. Bandwidth counts 28 bytes per element (read p, g, m, v; write p, m, v), 30 with
the bf16 copy-out. infinity is also timed with its compressed moment formats (`--moments`: bf16,
8bit; the moments start at zero and the warm-up rounds fill them), each against the bytes that
format moves (MomentFormat.step_bytes: 20 per element for bf16, about 16 for 8bit), as a fraction
of the streaming limit's bandwidth. The last line printed is one JSON object.

    python tools/bench_adam.py [--numel N] [--threads T] [--steps S] [--moments bf16,8bit] [--json]
"""

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch

from infinity._native_loader import load_native
from infinity.optim import adam_step_flat, moment_format, resolve_simd
from infinity.shards.moments import zero_state

BYTES_PER_ELEM = 28
BYTES_PER_ELEM_BF16_COPY = 30
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
Step = Callable[[], None]


def interleaved_times_ms(contenders: dict[str, Step], steps: int, warmup: int) -> dict[str, list[float]]:
    """Wall time of each contender's step in each of `steps` rounds (after `warmup`), in milliseconds."""
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + steps):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            contenders[name]()
            if round_index >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


@functools.lru_cache(maxsize=1)
def shared_grad(numel: int) -> torch.Tensor:
    """One gradient all contenders read (none writes it), to keep the benchmark's footprint down."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-2


def adam_buffers(numel: int, seed: int) -> dict[str, torch.Tensor]:
    """p, g, m, v as a trained model's optimizer would see them (no zeros, no denormals)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "p": torch.randn(numel, generator=gen),
        "g": shared_grad(numel),
        "m": torch.randn(numel, generator=gen) * 1e-3,
        "v": torch.rand(numel, generator=gen) * 1e-4,
    }


def torch_param(numel: int, seed: int) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.randn(numel, generator=torch.Generator().manual_seed(seed)))
    param.grad = shared_grad(numel)
    return param


def torch_step(numel: int, seed: int, cast: bool = False, **kw) -> Step:
    param = torch_param(numel, seed)
    opt = torch.optim.AdamW([param], **HYPER, **kw)
    if not cast:
        return opt.step
    copy = torch.empty(numel, dtype=torch.bfloat16)

    def step_and_cast() -> None:
        opt.step()
        copy.copy_(param.detach())

    return step_and_cast


def deepspeed_step(numel: int, seed: int) -> tuple[Step | None, str | None]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, f"deepspeed not importable: {type(exc).__name__}: {exc}"
    try:
        param = torch_param(numel, seed)
        opt = DeepSpeedCPUAdam([param], lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                               weight_decay=HYPER["weight_decay"], adamw_mode=True)  # fmt: skip
        opt.step()  # builds/loads the extension now, not inside a timed step
        return opt.step, None
    except Exception as exc:  # noqa: BLE001 - report, don't crash the benchmark
        return None, f"DeepSpeedCPUAdam failed: {type(exc).__name__}: {exc}"


def infinity_step(numel: int, seed: int, threads: int, simd: str, copy_dtype: torch.dtype | None = None) -> Step:
    buf = adam_buffers(numel, seed)
    out_copy = None if copy_dtype is None else torch.empty(numel, dtype=copy_dtype)
    count = [0]
    beta1, beta2 = HYPER["betas"]

    def step() -> None:
        count[0] += 1
        adam_step_flat(buf["p"], buf["g"], buf["m"], buf["v"], step=count[0], lr=HYPER["lr"],
                       beta1=beta1, beta2=beta2, eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                       out_copy=out_copy, num_threads=threads, simd=simd)  # fmt: skip

    return step


def infinity_moments_step(numel: int, seed: int, threads: int, simd: str, moments: str) -> Step:
    """infinity with exp_avg/exp_avg_sq stored in `moments` (zero at first; the warm-up rounds fill them)."""
    buf = adam_buffers(numel, seed)
    del buf["m"], buf["v"]
    state = zero_state(moments, numel)
    count = [0]
    beta1, beta2 = HYPER["betas"]

    def step() -> None:
        count[0] += 1
        adam_step_flat(buf["p"], buf["g"], state["exp_avg"], state["exp_avg_sq"], step=count[0], lr=HYPER["lr"],
                       beta1=beta1, beta2=beta2, eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                       num_threads=threads, simd=simd, moments=moments, exp_avg_scale=state.get("exp_avg_scale"),
                       exp_avg_sq_scale=state.get("exp_avg_sq_scale"))  # fmt: skip

    return step


def stream_limit_step(numel: int, seed: int, threads: int, simd: str) -> Step:
    buf = adam_buffers(numel, seed)
    ptrs = [buf[k].data_ptr() for k in ("p", "g", "m", "v")]
    kernel = load_native().adam.stream_rw_kernel

    def step() -> None:
        kernel(*ptrs, numel, simd, threads)
        assert buf  # the closure must own the buffers behind the raw pointers

    return step


def gbps(numel: int, ms: float, bytes_per_elem: float = BYTES_PER_ELEM) -> float:
    return numel * bytes_per_elem / (ms * 1e-3) / 1e9


def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None else num / den


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--steps", type=int, default=10, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--simd", default=None, help="force a path (default: $INFINITY_SIMD or the best)")
    parser.add_argument("--no-foreach", action="store_true", help="skip torch foreach (the slow one)")
    parser.add_argument("--moments", default="bf16,8bit", help="compressed moment formats to time ('' for none)")
    parser.add_argument("--json", action="store_true", help="(the JSON line is always printed last)")
    args = parser.parse_args()

    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    simd = resolve_simd(args.simd)
    n = args.numel
    print(f"numel={n:,} threads={args.threads} simd={simd} rounds={args.steps} warmup={args.warmup}")

    contenders: dict[str, Step] = {
        "limit": stream_limit_step(n, 1, args.threads, simd),
        "infinity": infinity_step(n, 2, args.threads, simd),
        "infinity_bf16_copy": infinity_step(n, 3, args.threads, simd, torch.bfloat16),
        "torch_fused_plus_cast": torch_step(n, 4, cast=True, fused=True),
    }
    moment_formats = [moment_format(name).name for name in args.moments.split(",") if name]
    for fmt in moment_formats:
        contenders[f"infinity_moments_{fmt}"] = infinity_moments_step(n, 8, args.threads, simd, fmt)
    r: dict[str, object] = {"numel": n, "threads": args.threads, "simd": simd}
    try:
        contenders["torch_fused"] = torch_step(n, 5, fused=True)
        contenders["torch_fused"]()
    except (RuntimeError, ValueError) as exc:
        r["torch_fused_error"] = f"{type(exc).__name__}: {exc}"
        for name in ("torch_fused", "torch_fused_plus_cast"):
            contenders.pop(name, None)
    if not args.no_foreach:
        contenders["torch_foreach"] = torch_step(n, 6, foreach=True)
    ds, error = deepspeed_step(n, 7)
    if ds is not None:
        contenders["deepspeed"] = ds
    else:
        r["deepspeed_error"] = error

    times = interleaved_times_ms(contenders, args.steps, args.warmup)
    ms = {name: statistics.median(t) for name, t in times.items()}
    r["limit_ms"] = ms["limit"]
    r["limit_gbps"] = gbps(n, ms["limit"])
    for name in ("torch_foreach", "torch_fused", "deepspeed", "infinity", "torch_fused_plus_cast",
                 "infinity_bf16_copy"):  # fmt: skip
        r[f"{name}_ms"] = ms.get(name)
    r["infinity_gbps"] = gbps(n, ms["infinity"])
    r["fraction_of_limit"] = r["infinity_gbps"] / r["limit_gbps"]
    r["infinity_bf16_copy_gbps"] = gbps(n, ms["infinity_bf16_copy"], BYTES_PER_ELEM_BF16_COPY)
    torch_times = [t for t in (r["torch_foreach_ms"], r["torch_fused_ms"]) if t is not None]
    r["speedup_vs_torch"] = min(torch_times) / ms["infinity"] if torch_times else None
    r["speedup_vs_deepspeed"] = ratio(r["deepspeed_ms"], ms["infinity"])
    r["speedup_bf16_copy_vs_torch"] = ratio(r["torch_fused_plus_cast_ms"], ms["infinity_bf16_copy"])
    r["moments"] = {"fp32": {"ms": ms["infinity"], "bytes_per_elem": BYTES_PER_ELEM, "gbps": r["infinity_gbps"],
                             "fraction_of_limit": r["fraction_of_limit"]}}  # fmt: skip
    for fmt in moment_formats:
        fmt_ms = ms[f"infinity_moments_{fmt}"]
        bytes_per_elem = moment_format(fmt).step_bytes(n) / n
        fmt_gbps = gbps(n, fmt_ms, bytes_per_elem)
        r["moments"][fmt] = {"ms": fmt_ms, "bytes_per_elem": bytes_per_elem, "gbps": fmt_gbps,
                             "fraction_of_limit": fmt_gbps / r["limit_gbps"]}  # fmt: skip

    for name, value in ms.items():
        print(f"{name:24s} median {value:9.2f} ms   (min {min(times[name]):9.2f}, max {max(times[name]):9.2f})")
    print(f"limit {r['limit_gbps']:.1f} GB/s; infinity {r['infinity_gbps']:.1f} GB/s "
          f"= {r['fraction_of_limit']:.3f} of the limit")  # fmt: skip
    for fmt, m in r["moments"].items():
        print(f"moments {fmt:5s} {m['ms']:9.2f} ms  {m['bytes_per_elem']:5.2f} B/elem  {m['gbps']:6.1f} GB/s "
              f"= {m['fraction_of_limit']:.3f} of the limit")  # fmt: skip
    print(f"speedup vs best torch {r['speedup_vs_torch']}, vs deepspeed {r['speedup_vs_deepspeed']}, "
          f"bf16 copy-out vs torch fused+cast {r['speedup_bf16_copy_vs_torch']}")  # fmt: skip
    print(json.dumps(r))


if __name__ == "__main__":
    main()
