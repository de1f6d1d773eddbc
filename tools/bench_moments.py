"""Loss equivalence and Adam cost of the moment formats (fp32, bf16, 8bit) at a real size.

For each format in turn, a GPT preset (`--preset`, default 110m) is trained from the same seed on the
same batches of the bundled corpus for `--steps` steps (default 300) with CPUAdamW(moments=format),
the learning rate warmed up linearly over `--lr-warmup-steps`.
The model runs on `--device` (default: cuda when there is one, else cpu); the fp32 master weights and
the optimizer always live on the CPU, as with offload_optimizer: on a GPU, each step copies the
gradients to the masters, steps them, and copies the weights back.

Reported per format: the final training loss (mean of the last `--avg-last` steps' losses), the
held-out loss on `--val-batches` fixed validation batches, both as ratios to fp32 (the target is within
1%), and the Adam time per step (median of the optimizer.step() wall times after `--warmup` steps)
against the memory-bandwidth bound: the bytes one pass moves (MomentFormat.step_bytes: fp32 p read and
written, fp32 grad read, both moments and their scales read and written; 28, 20 and about 16 bytes per
element) at the bandwidth of the native streaming kernel (Adam's access pattern, 28 bytes per element,
measured on an array as long as the model before training). Timings are meaningful on a quiet machine
only. The last line printed is one JSON object.

    python tools/bench_moments.py [--preset 110m] [--steps 300] [--batch 8] [--seq 1024]
                                  [--formats fp32,bf16,8bit] [--device cuda|cpu] [--threads T]

`--spread-seed S` also trains fp32 from another initialization on the same batches: how far two exact
runs end apart, the yardstick for the 1% criterion.

Develop with `--preset tiny --steps 20`; at 110m a CPU-only run takes minutes per step.
"""

import argparse
import json
import statistics
import time

import torch

from infinity._native_loader import load_native
from infinity.data.corpus import ByteBatches, load_corpus
from infinity.models.gpt import GPT, count_params, gpt_preset
from infinity.optim import CPUAdamW, moment_format, resolve_simd


def stream_gbps(numel: int, threads: int, simd: str, rounds: int = 5) -> float:
    """Bandwidth of Adam's access pattern (read p, g, m, v; write p, m, v) over `numel` fp32 elements."""
    p, g, m, v = (torch.ones(numel) for _ in range(4))
    kernel = load_native().adam.stream_rw_kernel
    times = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        kernel(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), numel, simd, threads)
        times.append(time.perf_counter() - start)
    return numel * 28 / statistics.median(times[1:]) / 1e9


def train(args: argparse.Namespace, fmt: str, device: torch.device, init_seed: int | None = None) -> dict:
    """One training run with moments in `fmt` (the model initialized from `init_seed`, default --seed; the
    batches always from --seed): losses and optimizer step times."""
    torch.manual_seed(args.seed if init_seed is None else init_seed)
    cfg = gpt_preset(args.preset, **({"block_size": args.seq} if args.seq else {}))
    model = GPT(cfg).to(device)
    params = list(model.parameters())
    masters = params if device.type == "cpu" else [torch.nn.Parameter(p.detach().cpu().clone()) for p in params]
    opt = CPUAdamW(masters, lr=args.lr, weight_decay=args.weight_decay, num_threads=args.threads, moments=fmt)
    batches = ByteBatches(load_corpus("train"), args.batch, cfg.block_size, seed=args.seed)
    losses, step_s = [], []
    start = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / max(1, args.lr_warmup_steps))
        x, y = (t.to(device) for t in next(batches))
        _, loss = model(x, y)
        for p in params:
            p.grad = None
        loss.backward()
        if masters is not params:
            for master, p in zip(masters, params, strict=True):
                master.grad = p.grad.to("cpu", torch.float32)
        t0 = time.perf_counter()
        opt.step()
        step_s.append(time.perf_counter() - t0)
        if masters is not params:
            with torch.no_grad():
                for master, p in zip(masters, params, strict=True):
                    p.copy_(master)
        losses.append(loss.item())
        if args.print_every and (step + 1) % args.print_every == 0:
            print(f"  {fmt} step {step + 1}: loss {losses[-1]:.4f}", flush=True)
    train_s = time.perf_counter() - start
    val = ByteBatches(load_corpus("val"), args.batch, cfg.block_size, seed=args.seed + 1)
    with torch.no_grad():
        val_loss = statistics.fmean(model(*(t.to(device) for t in next(val)))[1].item()
                                    for _ in range(args.val_batches))  # fmt: skip
    timed = step_s[args.warmup :] or step_s
    return {
        "final_loss": statistics.fmean(losses[-args.avg_last :]),
        "val_loss": val_loss,
        "adam_ms_per_step": statistics.median(timed) * 1e3,
        "adam_ms_min": min(timed) * 1e3,
        "train_s": train_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="110m")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's block_size)")
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--lr-warmup-steps", type=int, default=30, help="linear learning-rate warm-up")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--formats", default="fp32,bf16,8bit", help="comma-separated; fp32 first is the yardstick")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU Adam threads")
    parser.add_argument("--simd", default=None, help="force a path (default: $INFINITY_SIMD or the best)")
    parser.add_argument("--avg-last", type=int, default=20, help="final loss = mean of this many last steps")
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps left out of the timing")
    parser.add_argument("--print-every", type=int, default=0)
    parser.add_argument("--spread-seed", type=int, default=None,
                        help="also train fp32 from this init seed (same batches): the run-to-run spread")
    args = parser.parse_args()

    torch.set_flush_denormal(True)
    simd = resolve_simd(args.simd)
    formats = [moment_format(name).name for name in args.formats.split(",")]
    device = torch.device(args.device)
    cfg = gpt_preset(args.preset, **({"block_size": args.seq} if args.seq else {}))
    numel = count_params(cfg)
    limit_gbps = stream_gbps(numel, args.threads, simd)
    print(f"preset={args.preset} params={numel:,} steps={args.steps} batch={args.batch} seq={cfg.block_size} "
          f"device={device} threads={args.threads} simd={simd} limit={limit_gbps:.1f} GB/s", flush=True)  # fmt: skip

    results: dict[str, dict] = {}
    for fmt in formats:
        r = train(args, fmt, device)
        r["bytes_per_elem"] = moment_format(fmt).step_bytes(numel) / numel
        r["bound_ms"] = numel * r["bytes_per_elem"] / (limit_gbps * 1e9) * 1e3
        r["fraction_of_bound"] = r["bound_ms"] / r["adam_ms_per_step"]
        results[fmt] = r
        print(f"{fmt:5s} final {r['final_loss']:.4f} val {r['val_loss']:.4f} adam {r['adam_ms_per_step']:.2f} ms "
              f"(bound {r['bound_ms']:.2f} ms, {r['bytes_per_elem']:.2f} B/elem, "
              f"{r['fraction_of_bound']:.2f} of it) train {r['train_s']:.1f} s", flush=True)  # fmt: skip
    if args.spread_seed is not None:
        r = train(args, "fp32", device, init_seed=args.spread_seed)
        results[f"fp32_init_seed_{args.spread_seed}"] = r
        print(f"fp32 from init seed {args.spread_seed}: final {r['final_loss']:.4f} "
              f"val {r['val_loss']:.4f}", flush=True)
    base = results.get("fp32")
    for r in results.values():
        r["final_ratio_to_fp32"] = None if base is None else r["final_loss"] / base["final_loss"]
        r["val_ratio_to_fp32"] = None if base is None else r["val_loss"] / base["val_loss"]
    within = [abs(r["val_ratio_to_fp32"] - 1) <= 0.01 for name, r in results.items() if name in formats and base]
    print(json.dumps({
        "preset": args.preset, "params": numel, "steps": args.steps, "batch": args.batch, "seq": cfg.block_size,
        "lr": args.lr, "device": str(device), "threads": args.threads, "simd": simd, "limit_gbps": limit_gbps,
        "formats": results, "val_within_1pct_of_fp32": all(within) if within else None,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
