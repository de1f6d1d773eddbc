"""Out-of-core scale benchmark: a model of `--params` parameters trained with all its state on NVMe, against an
honest bound: the fewest bytes the step must move at fio's bandwidth measured in the same run.

What it measures, in one process (world size 1, the CPU as the compute device when there is no GPU):

1. The disk: fio, sequential direct-I/O write then read of one file (`--fio-gib`, 1 MiB blocks,
   libaio, `--fio-iodepth`) on the NVMe path, before the model is built and after it is closed; the
   faster of the two runs, read and write apart.
2. The model: Llama-shaped (`--arch llama`, the default: RMSNorm, SwiGLU, rotary positions; byte
   vocabulary) or GPT (`--arch gpt`) of about `--params` parameters: the nearest preset's width with
   n_layer set to come nearest the target (--params 7e9: Llama 7B's width, 35 layers, 7.09e9;
   --params 3e9 --arch gpt: the 3b preset). Built under `infinity.Init` and materialized block by block by
   `infinity.initialize` with offload_param and offload_optimizer on NVMe,
   `zero_optimization.host_budget_bytes` = `--host-budget-gib`, `gradient_clipping` = `--clip`, bf16
   with `--dtype bf16`, `zero_optimization.sub_group_size` 5e7 (a 7B layer's optimizer state streams
   through an 8 GiB budget in pieces; `--zero` overrides it), and
   `zero_optimization.offload_optimizer.moments` = `--moments` unless fp32
   (an engine that refuses a setting has its error reported in the JSON).
3. Training: `--warmup` untimed steps (default 2: the engine's host pools reach their steady size in
   its first two steps, see below), then `--steps` timed steps on random tokens. Per step: wall time per
   phase, the bytes the process read from and wrote to the disk (/proc/self/io: direct I/O counts,
   the page cache is not involved) and the engine's own counters (engine.bytes_moved, engine.stall_s).
4. Memory: VmHWM of this process, after initialization and at the end; a side thread samples VmRSS
   every 20 ms to say in which phase and call the peak was reached. Disk: the swap files' allocated
   bytes after the timed steps.
5. The bound (benchlib/scale_bound.py): the minimum bytes (optimizer state read and written once,
   parameters read once for forward and, fused with the step's state read, once for backward, no
   gradient traffic), io_s at fio's read and write bandwidth (additive, and io_s_overlap if reads and
   writes overlapped), compute_s from one layer in plain PyTorch in memory (child process) x n_layer
   + the head. bound_s = max(compute_s, io_s); ratio_to_bound = step_s / bound_s.
6. With `--profile DIR`, the engine's profiler records swap traces of the timed steps (not the warm-ups)
   into DIR; `infinity profile DIR` reads them (where each step's time went, and what to change).

JSON (last line of stdout): params, step_s (median of the timed steps), peak_rss_bytes, disk_bytes_per_param
(swap bytes on disk / params), moved_bytes_per_param_per_step ((read + written) / params, /proc/self/io,
median step), ratio_to_bound, ratio_to_overlapped_bound, bound_s, io_s, io_s_overlap, compute_s, min_bytes
(the bound's parts), min_disk_bytes_per_param, bytes_read / bytes_written, engine_bytes_moved, phases_s,
warmup_steps, per-step records (the warm-ups first), fio runs, and the settings. A run that fails prints
{"error", ...} and exits 1.

Before anything it checks the free disk against infinity.estimator's NVMe figure for the model (its
moments format, and gradient slots only with clipping, as the engine lays them out) or fio's file,
whichever is larger (fio's file is gone before the swap file is made, and the swap before fio's second
run), plus a margin, and refuses when it does not fit. The swap files live in
`<nvme-path>/.bench-scale-<pid>/`, removed at the end, on errors and on SIGTERM/SIGINT/SIGHUP; folders
left by killed runs (dead pid) are removed at start.

The process re-executes itself with MALLOC_MMAP_THRESHOLD_=1048576 (glibc otherwise keeps freed
block-sized buffers in its heap and the RSS grows); `--malloc default` measures without it. It also
sets GLIBC_TUNABLES=glibc.malloc.hugetlb=1 where the kernel gives transparent huge pages on request, as
the infinity command does for a run with a host budget (see infinity.engine.host_memory);
`--huge-pages off` measures without it.
`--gc-interval-s S` runs gc.collect() every S seconds from a side thread, its cost reported.

Why two warm-up steps: the shard store's host buffer pool adds slabs as it first needs them and keeps them,
and the bytes it has lent at once reach their steady peak only in the second step's backward (six
layers of the 7B width under the 8 GiB budget: at most 1.07 GB in use in step 0's backward, 2.41 GB in
step 1's; slabs after init, step 0's forward and backward, step 1's forward and backward, then step 2:
0.29, 0.80, 1.26, 1.60, 2.62, 2.67 GB). Each new slab is fresh memory that the kernel zeroes and that this
VM's host backs again. So the first two steps are the slow ones (at that size 21-29 s each, then 10-18 s; at
7B after one warm-up step, the first timed step took 66-73 s and the second 53-59 s in five of six runs).
A run of many steps pays it once.
`--warmup 1` measures as before.

    python tools/bench_scale.py --params 3e9 --host-budget-gib 8 [--arch llama|gpt] [--dtype fp32|bf16]
                                [--moments fp32|bf16|8bit] [--clip 1.0] [--nvme-path DIR] [--steps N]
                                [--warmup N] [--json]

Develop with --params 1e8 or less. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchlib import scale_bound, shapes
from benchlib.measure import disk_io, folder_bytes, peak_rss_bytes, raw_disk
from benchlib.scale_bound import COMPUTE_BYTES
from benchlib.scale_disk import check_disk, disk_need
from benchlib.scale_report import summarize
from benchlib.scale_steps import timed_steps
from benchlib.scratch import install_signal_handlers, remove_stale_dirs, scratch_dir
from benchlib.watch import PeriodicGC, RssWatch

MALLOC_ENV = "MALLOC_MMAP_THRESHOLD_"
MALLOC_TUNED = "1048576"
GiB = 1 << 30
DIR_PREFIX = ".bench-scale-"

# -- process setup (before torch is imported: glibc reads its tunables when the process starts) --------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, required=True, help="target parameter count, e.g. 3e9")
    parser.add_argument("--arch", choices=shapes.ARCHS, default="llama")
    parser.add_argument("--preset", default=None, help="this preset of --arch as is, not chosen by --params")
    parser.add_argument("--n-layer", type=int, default=None, help="override the chosen shape's n_layer")
    parser.add_argument("--host-budget-gib", type=float, default=8.0, help="zero_optimization.host_budget_bytes")
    parser.add_argument("--device-budget-gib", type=float, default=None, help="zero_optimization.device_budget_bytes")
    parser.add_argument("--nvme-path", default=None, help="folder on the disk to swap to (default: the repository)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after the warm-up steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (their records are in the JSON)")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--clip", type=float, default=0.0, help="gradient_clipping (0: off)")
    parser.add_argument("--dtype", choices=tuple(COMPUTE_BYTES), default="fp32", help="compute and parameter shards")
    parser.add_argument("--bf16", action="store_const", const="bf16", dest="dtype", help=argparse.SUPPRESS)
    parser.add_argument("--moments", choices=tuple(scale_bound.MOMENT_BYTES), default="fp32",
                        help="zero_optimization.offload_optimizer.moments (fp32: the key is not set)")  # fmt: skip
    parser.add_argument("--aio", default="{}", help="aio section as JSON, e.g. '{\"queue_depth\": 32}'")
    parser.add_argument("--zero", default="{}", help="extra zero_optimization keys as JSON (a section's keys, e.g. "
                        "'{\"offload_optimizer\": {\"buffer_count\": 8}}', join those set here)")  # fmt: skip
    parser.add_argument("--fio-gib", type=float, default=2.0, help="size of fio's file")
    parser.add_argument("--fio-iodepth", type=int, default=32)
    parser.add_argument("--no-fio", action="store_true", help="skip fio (no io bound, no ratio)")
    parser.add_argument("--malloc", choices=("tuned", "default"), default="tuned",
                        help=f"tuned: re-exec with {MALLOC_ENV}={MALLOC_TUNED}; default: glibc's own")  # fmt: skip
    parser.add_argument("--huge-pages", choices=("on", "off"), default="on",
                        help="on: glibc's malloc asks for transparent huge pages, as the infinity command "
                        "starts (GLIBC_TUNABLES=glibc.malloc.hugetlb=1); off: it does not")  # fmt: skip
    parser.add_argument("--gc-interval-s", type=float, default=0.0,
                        help="run gc.collect() every this many seconds from a side thread (0: off)")  # fmt: skip
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="record swap traces of the timed steps into DIR (read them with `infinity profile DIR`)")
    parser.add_argument("--json", action="store_true", help="stderr: progress only; stdout: the JSON line")
    parser.add_argument("--reference-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.steps < 1:
        parser.error(f"--warmup must be >= 0 and --steps >= 1, got {args.warmup} and {args.steps}")
    for flag in ("aio", "zero"):
        try:
            section = json.loads(getattr(args, flag))
        except json.JSONDecodeError as exc:
            parser.error(f"--{flag} is not JSON ({exc}): give an object, e.g. '{{\"queue_depth\": 16}}'")
        if not isinstance(section, dict):
            parser.error(f"--{flag} must be a JSON object of config keys, got {getattr(args, flag)!r}")
    return args


def reexec_for_malloc(args: argparse.Namespace) -> None:
    """Restart this interpreter with the malloc settings asked for, unless they are in effect already."""
    from infinity.engine.host_memory import huge_pages_environment, without_huge_pages

    want = MALLOC_TUNED if args.malloc == "tuned" else None
    env = dict(os.environ)
    if not (os.environ.get(MALLOC_ENV) == want or (args.malloc == "tuned" and os.environ.get(MALLOC_ENV))):
        if want is None:  # else a value the user set themselves is respected
            env.pop(MALLOC_ENV, None)
        else:
            env[MALLOC_ENV] = want
    # as the infinity command starts (infinity.engine.host_memory); the reference child inherits it
    env = (huge_pages_environment(env) or env) if args.huge_pages == "on" else without_huge_pages(env)
    if env == dict(os.environ):
        return
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)


def log(message: str) -> None:
    print(f"[bench_scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the run's pieces ------------------------------------------------------------------------------------------


SUB_GROUP_SIZE = 50_000_000  # the optimizer's unit: a 7B layer (202M elements) would not stream through 8 GiB


def engine_config(args: argparse.Namespace, nvme_dir: Path) -> dict:
    offload_optimizer: dict[str, Any] = {"device": "nvme", "nvme_path": str(nvme_dir)}
    if args.moments != "fp32":
        offload_optimizer["moments"] = args.moments
    zero = {
        "stage": 3,
        "block_classes": [shapes.BLOCK_CLASS[args.arch]],
        "offload_param": {"device": "nvme", "nvme_path": str(nvme_dir)},
        "offload_optimizer": offload_optimizer,
        "host_budget_bytes": int(args.host_budget_gib * GiB),
        "device_budget_bytes": None if args.device_budget_gib is None else int(args.device_budget_gib * GiB),
        "sub_group_size": SUB_GROUP_SIZE,
    }
    for key, value in json.loads(args.zero).items():  # a section's keys join the section's (nvme_path stays)
        zero[key] = {**zero[key], **value} if isinstance(value, dict) and isinstance(zero.get(key), dict) else value
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "aio": json.loads(args.aio),
        "bf16": {"enabled": args.dtype == "bf16"},
    }
    if args.profile is not None:  # the timed steps: the warm-ups are steps 0 .. warmup - 1
        config["profiler"] = {"enabled": True, "path": args.profile, "start_step": args.warmup}
    return config


def token_batches(batch: int, seq: int, vocab: int) -> Iterator[tuple[Any, Any]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    while True:
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        yield tokens[:, :-1], tokens[:, 1:]


def reference_child(spec: str) -> None:
    """`--reference-child SPEC`: the in-memory compute reference in this (child) process; prints its JSON."""
    import torch

    torch.set_flush_denormal(True)
    job = json.loads(spec)
    cfg = shapes.config_from_dict(job["arch"], job["cfg"])
    dtype = torch.bfloat16 if job["dtype"] == "bf16" else torch.float32
    print(json.dumps(scale_bound.compute_in_memory(job["arch"], cfg, job["batch"], job["seq"], dtype)))


def compute_reference(cfg: Any, args: argparse.Namespace) -> dict[str, float]:
    """The in-memory reference in a child process, so that its memory does not count in this process's peak."""
    spec = json.dumps({"arch": args.arch, "cfg": shapes.describe(cfg), "batch": args.batch, "seq": args.seq,
                       "dtype": args.dtype})  # fmt: skip
    cmd = [sys.executable, os.path.abspath(__file__), "--params", "0", "--reference-child", spec]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the in-memory reference failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def train(args: argparse.Namespace, cfg: Any, nvme_dir: Path) -> dict[str, Any]:
    """Build under Init, initialize (materialize + offload), train; the engine is closed in every case."""
    import infinity

    config = engine_config(args, nvme_dir)
    io_before = disk_io()
    watch = RssWatch()
    watch.phase = "init"
    start = time.perf_counter()
    try:
        with infinity.Init(config=config):
            model = shapes.build(args.arch, cfg)
        assert all(p.is_meta for p in model.parameters()), "infinity.Init did not build on the meta device"
        params = sum(p.numel() for p in model.parameters())  # before the engine turns them into views of its shards
        engine, _, _, _ = infinity.initialize(model=model, config=config)
    except BaseException:
        watch.stop()
        raise
    collector = PeriodicGC(args.gc_interval_s)
    try:
        init_s = time.perf_counter() - start
        init_io = [after - before for after, before in zip(disk_io(), io_before, strict=True)]
        log(f"initialized {params:,} parameters in {init_s:.1f} s; peak RSS so far {peak_rss_bytes() / GiB:.2f} GiB")
        out: dict[str, Any] = {"params": params, "init_s": round(init_s, 2)}
        out["peak_rss_after_init_bytes"] = peak_rss_bytes()
        data = token_batches(args.batch, args.seq, cfg.vocab_size)
        steps = timed_steps(engine, data, args.warmup, args.steps, watch, log)
        out["swap_bytes_on_disk"] = folder_bytes(nvme_dir)
        out["peak_rss_bytes"] = peak_rss_bytes()
        out["sampled_peak_rss"] = {"bytes": watch.max_bytes, "where": watch.where}
        out["gc_workaround"] = {"interval_s": args.gc_interval_s, "runs": collector.runs, "seconds": collector.seconds}
        out["disk_io_during_init"] = {"read_bytes": init_io[0], "written_bytes": init_io[1]}
        out["steps"] = steps
        if not all(math.isfinite(s["loss"]) for s in steps):
            raise RuntimeError(f"non-finite loss: {[s['loss'] for s in steps]}")
        return out
    finally:
        collector.stop()
        watch.stop()
        engine.close()


# -- the run ---------------------------------------------------------------------------------------------------


def choose_shape(args: argparse.Namespace) -> tuple[Any, str]:
    from dataclasses import replace

    cfg, how = shapes.choose_shape(args.arch, args.params, args.preset, args.seq)
    if args.n_layer is not None:
        cfg, how = replace(cfg, n_layer=args.n_layer), f"{how}, n_layer={args.n_layer} as asked"
    return cfg, how


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_flush_denormal(True)
    compute_bytes = COMPUTE_BYTES[args.dtype]
    cfg, how = choose_shape(args)
    expected = shapes.count(args.arch, cfg)
    log(f"model: {args.arch} n_layer={cfg.n_layer} n_embd={cfg.n_embd} n_head={cfg.n_head}, {expected:,} parameters "
        f"({how})")  # fmt: skip
    base = Path(args.nvme_path or Path(__file__).resolve().parent.parent).resolve()
    if not base.is_dir():
        raise SystemExit(f"--nvme-path {base} is not a folder")
    remove_stale_dirs(base, DIR_PREFIX)
    fio_bytes = 0 if args.no_fio else int(args.fio_gib * GiB)
    need = disk_need(args.arch, cfg, compute_bytes, args.moments, fio_bytes, clip=args.clip > 0)
    free = check_disk(base, need, expected, log)
    from infinity.config import load_config

    load_config(engine_config(args, base))  # a setting the engine refuses fails now, before fio and the reference

    log("timing one layer, the head and Adam in memory (child process)")
    refs = [compute_reference(cfg, args)]
    load = [os.getloadavg()[0]]
    raw_runs: list[dict[str, float]] = []
    with scratch_dir(base, DIR_PREFIX) as folder:
        if not args.no_fio:
            raw_runs.append(raw_disk(folder, fio_bytes, args.fio_iodepth))
            log(f"fio before: read {raw_runs[0]['read_gbps']} GB/s, write {raw_runs[0]['write_gbps']} GB/s")
        nvme_dir = folder / "swap"
        nvme_dir.mkdir()
        out = train(args, cfg, nvme_dir)
        shutil.rmtree(nvme_dir, ignore_errors=True)
        if not args.no_fio:
            raw_runs.append(raw_disk(folder, fio_bytes, args.fio_iodepth))
            log(f"fio after: read {raw_runs[1]['read_gbps']} GB/s, write {raw_runs[1]['write_gbps']} GB/s")
    load.append(os.getloadavg()[0])
    log("timing one layer, the head and Adam in memory again")
    refs.append(compute_reference(cfg, args))
    result = summarize(args, cfg, how, out, refs, raw_runs, need, free, base, load)
    result.update(malloc_mmap_threshold=os.environ.get(MALLOC_ENV), glibc_tunables=os.environ.get("GLIBC_TUNABLES"))
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
    try:
        result = run(args)
    except Exception as exc:  # the engine refusing a setting, or failing: reported, not lost in a traceback
        settings = {k: getattr(args, k) for k in ("params", "arch", "dtype", "moments", "clip", "host_budget_gib")}
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:],
                          **settings}), flush=True)  # fmt: skip
        log(f"failed: {type(exc).__name__}: {exc}")
        return 1
    summary = {k: result.get(k) for k in ("params", "dtype", "moments", "step_s", "bound_s", "ratio_to_bound")}
    log(f"done: {summary}, peak RSS {result['peak_rss_bytes'] / GiB:.2f} GiB")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
