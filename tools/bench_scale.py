"""Out-of-core scale benchmark: a GPT of `--params` parameters trained with all its state on NVMe.

What it measures, in one process (world size 1, the CPU as the compute device when there is no GPU):

1. The disk's raw bandwidth: fio, sequential direct-I/O write then read of one file (`--fio-gib`,
   1 MiB blocks, libaio, `--fio-iodepth`) in a scratch folder on the NVMe path; once before the
   model is built and once after it is closed. The bound below uses the faster of the two runs.
2. The model: a GPT (infinity.models.gpt) of about `--params` parameters, built under `infinity.Init`
   (meta device) and materialized block by block by `infinity.initialize` with offload_param and
   offload_optimizer both on NVMe and `zero_optimization.host_budget_bytes` = `--host-budget-gib`.
   Shape: the preset whose count is within 10% of the target, else the nearest preset's width with
   n_layer scaled to the target. The exact count is reported.
3. Training: one warm-up step, then `--steps` timed steps (forward, backward, optimizer step) on
   random byte tokens. Per step: wall time per phase, and the bytes the process read from and wrote
   to the disk (`/proc/self/io` read_bytes / write_bytes deltas: direct I/O is counted there, the
   page cache is not involved).
4. Peak RSS: VmHWM of this process (not ru_maxrss), after initialization and after training; a side
   thread samples VmRSS every 20 ms to say in which phase and call the peak was reached.
5. The step's lower bound, bound_s = max(compute_s, io_s):
   compute_s: forward+backward of ONE transformer Block of the same width in plain PyTorch, in memory,
   same batch/seq/dtype, times n_layer, plus the embedding/final-norm/head/loss once (median of 5, in
   a child process so its memory is not in the peak RSS; run before and after training, the faster kept);
   io_s: bytes_read / raw_read + bytes_written / raw_write (reads and writes share one disk).
   ratio_to_bound = step_s / bound_s. For information, the native CPU Adam over all parameters in
   memory (adam_in_memory_s) and a bound that adds it to the compute (bound_with_adam_s) are given too.

Before anything it checks the free disk (16 B/param of fp32 master, moments and gradient, plus 4 B
(fp32) or 2 B (bf16) per parameter for the parameter shards, plus fio's file, plus a margin) and
refuses when it does not fit. The swap files live in `<nvme-path>/.bench-scale-<pid>/`, removed at
the end, on errors and on SIGTERM/SIGINT; folders left by killed runs (dead pid) are removed at start.

The process re-executes itself with MALLOC_MMAP_THRESHOLD_=1048576 (glibc otherwise keeps freed
block-sized buffers in its heap and the RSS grows); `--malloc default` measures without it.
`--gc-interval-s S` is a workaround for a reference cycle in the store (freed buffers live until
Python's cyclic GC runs): gc.collect() every S seconds from a side thread, its cost reported.

    python tools/bench_scale.py --params 3e9 --host-budget-gib 8 [--nvme-path DIR] [--steps N]
                                [--seq 16] [--batch 1] [--bf16] [--clip 0] [--gc-interval-s 0.5] [--json]

Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

MALLOC_ENV = "MALLOC_MMAP_THRESHOLD_"
MALLOC_TUNED = "1048576"
GiB = 1 << 30
DIR_PREFIX = ".bench-scale-"
MARGIN_BYTES = 1 * GiB  # swap-file growth steps, slot alignment, the filesystem's own reserve

# -- process setup (before torch is imported: glibc reads its tunables when the process starts) --------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, required=True, help="target parameter count, e.g. 3e9")
    parser.add_argument("--preset", default=None, help="use this GPT preset as is instead of choosing by --params")
    parser.add_argument("--n-layer", type=int, default=None, help="override the chosen shape's n_layer")
    parser.add_argument("--host-budget-gib", type=float, default=8.0, help="zero_optimization.host_budget_bytes")
    parser.add_argument("--device-budget-gib", type=float, default=None, help="zero_optimization.device_budget_bytes")
    parser.add_argument("--nvme-path", default=None, help="folder on the disk to swap to (default: the repository)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after one warm-up step")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--clip",
        type=float,
        default=0.0,
        help="gradient_clipping; with it the optimizer waits for the global norm and streams after backward "
        "instead of stepping each block as its gradient arrives",
    )
    parser.add_argument("--bf16", action="store_true", help="bf16 compute and parameter shards (fp32 by default)")
    parser.add_argument("--aio", default="{}", help="aio section as JSON, e.g. '{\"queue_depth\": 32}'")
    parser.add_argument("--zero", default="{}", help="extra zero_optimization keys as JSON")
    parser.add_argument("--fio-gib", type=float, default=2.0, help="size of fio's file")
    parser.add_argument("--fio-iodepth", type=int, default=32)
    parser.add_argument("--no-fio", action="store_true", help="skip fio (no io bound, no ratio)")
    parser.add_argument(
        "--malloc",
        choices=("tuned", "default"),
        default="tuned",
        help=f"tuned: re-exec with {MALLOC_ENV}={MALLOC_TUNED}; default: glibc's own",
    )
    parser.add_argument(
        "--gc-interval-s",
        type=float,
        default=0.0,
        help="workaround: run gc.collect() every this many seconds from a side thread (0: off). The store's "
        "Copy objects hold their load job in a reference cycle, so freed buffers live until the cyclic GC runs",
    )
    parser.add_argument("--json", action="store_true", help="stderr: progress only; stdout: the JSON line")
    parser.add_argument("--reference-child", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def reexec_for_malloc(args: argparse.Namespace) -> None:
    """Restart this interpreter with the malloc setting asked for, unless it is already in effect."""
    want = MALLOC_TUNED if args.malloc == "tuned" else None
    if os.environ.get(MALLOC_ENV) == want or (args.malloc == "tuned" and os.environ.get(MALLOC_ENV)):
        return  # a value the user set themselves is respected
    env = dict(os.environ)
    if want is None:
        env.pop(MALLOC_ENV, None)
    else:
        env[MALLOC_ENV] = want
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)


def log(message: str) -> None:
    print(f"[bench_scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def install_signal_handlers() -> None:
    """SIGTERM/SIGHUP/SIGINT raise SystemExit, so the `finally` blocks remove the swap files."""

    def handler(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # keep nohup's SIGHUP ignored
            signal.signal(sig, handler)


# -- measuring -------------------------------------------------------------------------------------------------


def peak_rss_bytes() -> int:
    """This process's peak resident set, VmHWM (ru_maxrss inherits a parent's peak across fork/exec)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


class RssWatch:
    """A daemon thread sampling VmRSS every `period_s`; keeps the largest sample and where the main thread was.

    VmHWM gives the peak; this tells which phase and call reached it (the sample can miss a peak shorter
    than the period, so it reads at most VmHWM).
    """

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s = period_s
        self.max_bytes = 0
        self.where: list[str] = []
        self.phase = "start"
        self.per_phase: dict[str, int] = {}
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            rss = rss_bytes()
            phase = self.phase
            self.per_phase[phase] = max(self.per_phase.get(phase, 0), rss)
            if rss > self.max_bytes:
                self.max_bytes = rss
                frame = sys._current_frames().get(self._main)
                stack = traceback.extract_stack(frame)[-8:] if frame is not None else []
                self.where = [f"{phase}"] + [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class PeriodicGC:
    """A daemon thread calling gc.collect() every `interval_s` (the --gc-interval-s workaround); counts its time."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.runs = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-gc", daemon=True)
        if interval_s > 0:
            gc.freeze()  # the objects alive now (modules, torch's own) are never scanned again: collections stay cheap
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            start = time.perf_counter()
            gc.collect()
            self.seconds += time.perf_counter() - start
            self.runs += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def disk_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process has caused to reach the block device, all threads included."""
    values = {}
    with open("/proc/self/io") as f:
        for line in f:
            name, _, value = line.partition(":")
            values[name] = int(value)
    return values["read_bytes"], values["write_bytes"] - values.get("cancelled_write_bytes", 0)


def fio_gbps(path: Path, rw: str, size: int, iodepth: int) -> float:
    """Sequential direct-I/O bandwidth of `path` (bytes/s / 1e9), 1 MiB blocks, libaio."""
    cmd = [
        "fio", "--name=raw", f"--filename={path}", f"--size={size}", "--bs=1M", "--direct=1", f"--rw={rw}",
        "--ioengine=libaio", f"--iodepth={iodepth}", "--numjobs=1", "--output-format=json",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(done.stdout)["jobs"][0]
    return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


def raw_disk(folder: Path, size: int, iodepth: int) -> dict[str, float]:
    """fio write then read of one file in `folder`; the file is always removed."""
    path = folder / "fio.bin"
    try:
        write = fio_gbps(path, "write", size, iodepth)
        read = fio_gbps(path, "read", size, iodepth)
    finally:
        path.unlink(missing_ok=True)
    return {"read_gbps": round(read, 3), "write_gbps": round(write, 3)}


def median_time(fn: Callable[[], None], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


# -- the model -------------------------------------------------------------------------------------------------


def choose_shape(target: float, preset: str | None, seq: int):
    """(GPTConfig, how it was chosen): a preset within 10% of `target`, else the nearest one with n_layer scaled."""
    from infinity.models.gpt import GPT_PRESETS, count_params, gpt_preset

    if preset is not None:
        cfg, how = gpt_preset(preset), f"preset {preset!r} as asked"
    else:
        names = [n for n in GPT_PRESETS if n not in ("tiny", "small", "gpt2-110m")]
        name = min(names, key=lambda n: abs(math.log(count_params(GPT_PRESETS[n]) / target)))
        cfg = GPT_PRESETS[name]
        if abs(count_params(cfg) / target - 1) <= 0.10:
            how = f"preset {name!r} (within 10% of the target)"
        else:
            per_layer = count_params(replace(cfg, n_layer=2)) - count_params(replace(cfg, n_layer=1))
            fixed = count_params(replace(cfg, n_layer=1)) - per_layer
            n_layer = max(1, round((target - fixed) / per_layer))
            cfg = replace(cfg, n_layer=n_layer)
            how = f"preset {name!r}'s width (n_embd={cfg.n_embd}, n_head={cfg.n_head}) with n_layer scaled to {n_layer}"
    if seq > cfg.block_size:
        cfg = replace(cfg, block_size=seq)
    return cfg, how


def disk_need(params: int, itemsize: int, fio_bytes: int) -> dict[str, int]:
    optimizer = 16 * params  # fp32 master, exp_avg, exp_avg_sq, gradient
    shards = itemsize * params  # the parameter shards in the compute dtype
    return {
        "optimizer_state_bytes": optimizer,
        "param_shard_bytes": shards,
        "fio_bytes": fio_bytes,
        "margin_bytes": MARGIN_BYTES,
        "total_bytes": optimizer + shards + fio_bytes + MARGIN_BYTES,
    }


def engine_config(args: argparse.Namespace, nvme_dir: Path) -> dict:
    zero = {
        "stage": 3,
        "block_classes": ["Block"],
        "offload_param": {"device": "nvme", "nvme_path": str(nvme_dir)},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme_dir)},
        "host_budget_bytes": int(args.host_budget_gib * GiB),
        "device_budget_bytes": None if args.device_budget_gib is None else int(args.device_budget_gib * GiB),
        **json.loads(args.zero),
    }
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "aio": json.loads(args.aio),
        "bf16": {"enabled": bool(args.bf16)},
    }


def token_batches(batch: int, seq: int, vocab: int) -> Iterator[tuple[Any, Any]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    while True:
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        yield tokens[:, :-1], tokens[:, 1:]


# -- the in-memory reference: compute of the same blocks, and Adam ---------------------------------------------


def block_fwd_bwd_s(cfg, batch: int, seq: int, dtype, reps: int) -> tuple[float, int]:
    """(median seconds of forward+backward of one Block in plain PyTorch, the Block's parameter count)."""
    import torch

    from infinity.models.gpt import Block

    torch.manual_seed(0)
    block = Block(cfg).to(dtype)
    x = torch.randn(batch, seq, cfg.n_embd, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(batch, seq, cfg.n_embd, dtype=dtype)

    def step() -> None:
        block(x).backward(grad_out)
        block.zero_grad(set_to_none=True)  # the engine's gradients are fresh buffers each backward too
        x.grad = None

    return median_time(step, reps), sum(p.numel() for p in block.parameters())


def head_fwd_bwd_s(cfg, batch: int, seq: int, dtype, reps: int) -> float:
    """Forward+backward of the embeddings, final norm, tied head and loss (a GPT with no layers)."""
    import torch
    import torch.nn.functional as F

    from infinity.models.gpt import GPT

    model = GPT(replace(cfg, n_layer=0)).to(dtype)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq))

    def step() -> None:
        logits, _ = model(idx)
        F.cross_entropy(logits.float().view(-1, logits.size(-1)), idx.reshape(-1)).backward()
        model.zero_grad(set_to_none=True)

    return median_time(step, reps)


def adam_s_per_elem(elems: int, dtype, reps: int) -> float:
    """The native CPU AdamW (the engine's kernel) over `elems` fp32 elements in memory, per element."""
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


def compute_in_memory(cfg, batch: int, seq: int, dtype, reps: int = 5) -> dict[str, float]:
    """The in-memory reference of the step's compute: one Block, the head, and Adam per element."""
    block_s, block_elems = block_fwd_bwd_s(cfg, batch, seq, dtype, reps)
    return {
        "block_fwd_bwd_s": block_s,
        "head_fwd_bwd_s": head_fwd_bwd_s(cfg, batch, seq, dtype, reps),
        "block_elems": block_elems,
        "adam_s_per_elem": adam_s_per_elem(block_elems, dtype, reps),
    }


def reference_child(spec: str) -> None:
    """`--reference-child SPEC`: run compute_in_memory in this (child) process and print its JSON."""
    import torch

    from infinity.models.gpt import GPTConfig

    torch.set_flush_denormal(True)
    job = json.loads(spec)
    dtype = torch.bfloat16 if job["bf16"] else torch.float32
    print(json.dumps(compute_in_memory(GPTConfig(**job["cfg"]), job["batch"], job["seq"], dtype)))


def compute_reference(cfg, args: argparse.Namespace) -> dict[str, float]:
    """compute_in_memory in a child process, so that its memory does not count in this process's peak RSS."""
    spec = json.dumps({"cfg": dataclasses.asdict(cfg), "batch": args.batch, "seq": args.seq, "bf16": args.bf16})
    cmd = [sys.executable, os.path.abspath(__file__), "--params", "0", "--reference-child", spec]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the in-memory reference failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the run ---------------------------------------------------------------------------------------------------


def remove_stale_dirs(base: Path) -> None:
    """Remove `.bench-scale-<pid>` folders whose process is gone (a run killed with SIGKILL)."""
    for folder in base.glob(DIR_PREFIX + "*"):
        try:
            pid = int(folder.name[len(DIR_PREFIX) :])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            log(f"removing {folder}, left by a killed run (pid {pid})")
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            continue


@contextmanager
def scratch_dir(base: Path) -> Iterator[Path]:
    folder = base / f"{DIR_PREFIX}{os.getpid()}"
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        log(f"removed {folder}")


def train(args: argparse.Namespace, cfg, nvme_dir: Path) -> dict[str, Any]:
    """Build under Init, initialize (materialize + offload), train; the engine is closed in every case."""
    import infinity
    from infinity.models.gpt import GPT

    config = engine_config(args, nvme_dir)
    io_before = disk_io()
    watch = RssWatch()
    watch.phase = "init"
    start = time.perf_counter()
    with infinity.Init(config=config):
        model = GPT(cfg)
    assert all(p.is_meta for p in model.parameters()), "infinity.Init did not build on the meta device"
    engine, _, _, _ = infinity.initialize(model=model, config=config)
    collector = PeriodicGC(args.gc_interval_s)
    try:
        init_s = time.perf_counter() - start
        params = sum(f.numel for f in engine.flats)
        init_io = [after - before for after, before in zip(disk_io(), io_before, strict=True)]
        log(f"initialized {params:,} parameters in {init_s:.1f} s; peak RSS so far {peak_rss_bytes() / GiB:.2f} GiB")
        out: dict[str, Any] = {
            "params": params,
            "init_s": round(init_s, 2),
            "peak_rss_after_init_bytes": peak_rss_bytes(),
            "optimizer_window": engine.optimizer.window,
        }
        data = token_batches(args.batch, args.seq, cfg.vocab_size)
        steps = []
        for i in range(1 + args.steps):
            x, y = next(data)
            moved0, stall0 = dict(engine.bytes_moved), engine.stall_s
            io0 = disk_io()
            t0 = time.perf_counter()
            watch.phase = f"step {i} forward"
            _, loss = engine(x, y)
            loss_value = loss.item()
            io1, t1 = disk_io(), time.perf_counter()
            watch.phase = f"step {i} backward"
            engine.backward(loss)
            io2, t2 = disk_io(), time.perf_counter()
            watch.phase = f"step {i} optimizer"
            engine.step()
            io3, t3 = disk_io(), time.perf_counter()
            watch.phase = "between steps"
            moved = {k: v - moved0.get(k, 0) for k, v in engine.bytes_moved.items() if v != moved0.get(k, 0)}
            record = {
                "step_s": t3 - t0,
                "forward_s": t1 - t0,
                "backward_s": t2 - t1,
                "optimizer_s": t3 - t2,
                "bytes_read": io3[0] - io0[0],
                "bytes_written": io3[1] - io0[1],
                "read_by_phase": [io1[0] - io0[0], io2[0] - io1[0], io3[0] - io2[0]],
                "written_by_phase": [io1[1] - io0[1], io2[1] - io1[1], io3[1] - io2[1]],
                "stall_s": engine.stall_s - stall0,
                "store_bytes_moved": moved,
                "loss": loss_value,
                "rss_bytes": rss_bytes(),
                "sampled_peak_rss_by_phase": [
                    watch.per_phase.get(f"step {i} {phase}", 0) for phase in ("forward", "backward", "optimizer")
                ],
            }
            steps.append(record)
            kind = "warm-up" if i == 0 else f"step {i}/{args.steps}"
            log(
                f"{kind}: {record['step_s']:.2f} s (fwd {record['forward_s']:.2f}, bwd {record['backward_s']:.2f}, "
                f"opt {record['optimizer_s']:.2f}), read {record['bytes_read'] / 1e9:.2f} GB, "
                f"written {record['bytes_written'] / 1e9:.2f} GB, stall {record['stall_s']:.2f} s, "
                f"loss {loss_value:.4f}, RSS {record['rss_bytes'] / GiB:.2f} GiB (peak {peak_rss_bytes() / GiB:.2f})"
            )
        out["peak_rss_bytes"] = peak_rss_bytes()
        out["sampled_peak_rss"] = {"bytes": watch.max_bytes, "where": watch.where}
        out["gc_workaround"] = {"interval_s": args.gc_interval_s, "runs": collector.runs, "seconds": collector.seconds}
        out["store_stats"] = engine.store.stats()
        out["disk_io_during_init"] = {"read_bytes": init_io[0], "written_bytes": init_io[1]}
        out["steps"] = steps
        if not all(math.isfinite(s["loss"]) for s in steps):
            raise RuntimeError(f"non-finite loss: {[s['loss'] for s in steps]}")
        return out
    finally:
        collector.stop()
        watch.stop()
        engine.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from infinity.models.gpt import count_params

    torch.set_flush_denormal(True)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    cfg, how = choose_shape(args.params, args.preset, args.seq)
    if args.n_layer is not None:
        cfg, how = replace(cfg, n_layer=args.n_layer), f"{how}, n_layer={args.n_layer} as asked"
    expected = count_params(cfg)
    log(f"model: GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} n_head={cfg.n_head}, {expected:,} parameters ({how})")

    base = Path(args.nvme_path or Path(__file__).resolve().parent.parent).resolve()
    if not base.is_dir():
        raise SystemExit(f"--nvme-path {base} is not a folder")
    remove_stale_dirs(base)
    fio_bytes = 0 if args.no_fio else int(args.fio_gib * GiB)
    need = disk_need(expected, dtype.itemsize, fio_bytes)
    free = shutil.disk_usage(base).free
    log(
        f"disk: the run needs {need['total_bytes'] / 1e9:.1f} GB on {base} ({need['optimizer_state_bytes'] / 1e9:.1f} "
        f"optimizer state + {need['param_shard_bytes'] / 1e9:.1f} parameter shards + {fio_bytes / 1e9:.1f} fio + "
        f"{MARGIN_BYTES / 1e9:.1f} margin); {free / 1e9:.1f} GB free"
    )
    if need["total_bytes"] > free:
        most = (free - fio_bytes - MARGIN_BYTES) / (16 + dtype.itemsize)
        raise SystemExit(
            f"not enough disk on {base}: the run needs {need['total_bytes'] / 1e9:.1f} GB, {free / 1e9:.1f} GB is "
            f"free; ask for fewer parameters (--params {max(most, 0):.3g} fits) or point --nvme-path at a bigger disk"
        )

    log("timing one block, the head and Adam in memory (child process)")
    refs = [compute_reference(cfg, args)]
    load = [os.getloadavg()[0]]
    out: dict[str, Any] = {}
    with scratch_dir(base) as folder:
        raw_runs = []
        if not args.no_fio:
            raw_runs.append(raw_disk(folder, fio_bytes, args.fio_iodepth))
            log(f"fio before: read {raw_runs[0]['read_gbps']} GB/s, write {raw_runs[0]['write_gbps']} GB/s")
        nvme_dir = folder / "swap"
        nvme_dir.mkdir()
        out.update(train(args, cfg, nvme_dir))
        shutil.rmtree(nvme_dir, ignore_errors=True)
        if not args.no_fio:
            raw_runs.append(raw_disk(folder, fio_bytes, args.fio_iodepth))
            log(f"fio after: read {raw_runs[1]['read_gbps']} GB/s, write {raw_runs[1]['write_gbps']} GB/s")

    load.append(os.getloadavg()[0])
    log("timing one block, the head and Adam in memory again")
    refs.append(compute_reference(cfg, args))
    ref = {k: min(r[k] for r in refs) for k in refs[0]}  # the faster run: a lower bound
    params = out["params"]
    timed = out["steps"][1:] or out["steps"]
    step_s = statistics.median(s["step_s"] for s in timed)
    bytes_read = int(statistics.median(s["bytes_read"] for s in timed))
    bytes_written = int(statistics.median(s["bytes_written"] for s in timed))
    compute_s = cfg.n_layer * ref["block_fwd_bwd_s"] + ref["head_fwd_bwd_s"]
    adam_s = ref["adam_s_per_elem"] * params
    result: dict[str, Any] = {
        "params": params,
        "shape": {k: getattr(cfg, k) for k in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size", "bias")},
        "shape_chosen": how,
        "dtype": "bf16" if args.bf16 else "fp32",
        "batch": args.batch,
        "seq": args.seq,
        "timed_steps": len(timed),
        "step_s": round(step_s, 3),
        "peak_rss_bytes": out["peak_rss_bytes"],
        "peak_rss_gib": round(out["peak_rss_bytes"] / GiB, 3),
        "bytes_read": bytes_read,
        "bytes_written": bytes_written,
        "bytes_read_per_param": round(bytes_read / params, 2),
        "bytes_written_per_param": round(bytes_written / params, 2),
        "compute_s": round(compute_s, 3),
        "compute_method": "one Block fwd+bwd in plain PyTorch (same width, batch, seq, dtype) x n_layer "
        "+ embedding/ln_f/head/loss fwd+bwd once; median of 5, the faster of two runs (before and after training) "
        "in a child process",
        "adam_in_memory_s": round(adam_s, 3),
        "bound_with_adam_s": None,
        "init_s": out["init_s"],
        "peak_rss_after_init_bytes": out["peak_rss_after_init_bytes"],
        "sampled_peak_rss": out["sampled_peak_rss"],
        "gc_workaround": out["gc_workaround"],
        "state_bytes": 16 * params,
        "host_budget_bytes": int(args.host_budget_gib * GiB),
        "device_budget_bytes": None if args.device_budget_gib is None else int(args.device_budget_gib * GiB),
        "optimizer_window": out["optimizer_window"],
        "malloc_mmap_threshold": os.environ.get(MALLOC_ENV),
        "phases_s": {
            name: round(statistics.median(s[name] for s in timed), 3)
            for name in ("forward_s", "backward_s", "optimizer_s", "stall_s")
        },
        "steps": [
            {k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()} for s in out["steps"]
        ],  # steps[0] is the warm-up
        "store_stats": out["store_stats"],
        "disk_io_during_init": out["disk_io_during_init"],
        "disk_need": need,
        "disk_free_bytes": free,
        "nvme_path": str(base),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "compute_ref_runs": [{k: round(v, 12) if isinstance(v, float) else v for k, v in r.items()} for r in refs],
        "loadavg_1min_before_after": [round(x, 2) for x in load],
    }
    if raw_runs:
        raw_read = max(r["read_gbps"] for r in raw_runs) * 1e9
        raw_write = max(r["write_gbps"] for r in raw_runs) * 1e9
        io_s = bytes_read / raw_read + bytes_written / raw_write
        bound_s = max(compute_s, io_s)
        result.update(
            raw_read_gbps=round(raw_read / 1e9, 3),
            raw_write_gbps=round(raw_write / 1e9, 3),
            raw_disk_runs=raw_runs,
            fio={
                "bs": "1M",
                "iodepth": args.fio_iodepth,
                "size_bytes": fio_bytes,
                "direct": 1,
                "rw": "seq write, read",
            },
            io_s=round(io_s, 3),
            io_method="bytes_read / raw_read + bytes_written / raw_write (one disk: reads and writes add up)",
            bound_s=round(bound_s, 3),
            bound_by="io" if io_s >= compute_s else "compute",
            ratio_to_bound=round(step_s / bound_s, 3),
            bound_with_adam_s=round(max(compute_s + adam_s, io_s), 3),
            # If the disk read and wrote at full speed at once (it did in part here: the optimizer phase can beat
            # the additive io_s), only the larger of the two counts: a looser bound, the ratio against it too.
            io_s_if_rw_overlap=round(max(bytes_read / raw_read, bytes_written / raw_write), 3),
            ratio_to_overlapped_bound=round(
                step_s / max(compute_s, bytes_read / raw_read, bytes_written / raw_write), 3
            ),
        )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reference_child is not None:
        reference_child(args.reference_child)
        return 0
    if argv is None:
        reexec_for_malloc(args)
    install_signal_handlers()
    if shutil.which("fio") is None and not args.no_fio:
        raise SystemExit("fio is not installed (apt-get install -y fio), or pass --no-fio to skip the io bound")
    result = run(args)
    summary = {k: result.get(k) for k in ("params", "dtype", "step_s", "bound_s", "bound_by", "ratio_to_bound")}
    log(f"done: {summary}, peak RSS {result['peak_rss_bytes'] / GiB:.2f} GiB")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
