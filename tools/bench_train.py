"""Benchmarks training steps of the project's GPT: plain PyTorch vs infinity (offload none / cpu) vs DeepSpeed.

Each configuration trains the same model (same preset, seed and byte batches) for `--warmup` untimed
then `--steps` timed steps, in its own subprocess, so that its peak RSS (VmHWM) is its own:

    plain          torch.optim.AdamW(fused=True), fp32, no sharding
    infinity_none  infinity ZeRO-3, offload_param/offload_optimizer none
    infinity_cpu   infinity ZeRO-3, offload_param cpu + offload_optimizer cpu (native CPU Adam)
    deepspeed_cpu  DeepSpeed ZeRO-3, offload_param cpu + offload_optimizer cpu (DeepSpeedCPUAdam), one
                   process over Gloo on its CPU accelerator; only when `deepspeed` is importable

Per configuration: median step time, tokens/s, peak RSS, step time relative to plain, the median
forward / backward / optimizer-step split, and the losses (to check every configuration trains alike).
Infinity configurations also report, per timed step, the bytes moved between tiers from the engine's
counters (`engine.bytes_moved`: "nvme->host" parameter shards read for gathers and optimizer state
streamed, "host->nvme" state written back, "device->host" gradient shards handed to the offloaded
optimizer), the compute's stall time (`engine.stall_s`), and `engine_s`: time inside gathers, shard
fetches, releases, gradient reductions (with an NVMe optimizer, the shards stepped as their gradients
arrive) and the Adam step, measured by wrapping the engine's objects from outside. With one rank and
shards in memory (none, cpu) the parameters are views of the shards and nothing moves but gradients;
on a CPU-only machine the compute reads host memory, so no "->device" bytes appear.
Compare configurations within one run only: this machine's memory bandwidth drifts over time.

    python tools/bench_train.py [--model-size 110m] [--steps 4] [--warmup 2] [--batch 4] [--seq 256]
                                [--configs plain,infinity_none,infinity_cpu,deepspeed_cpu] [--json]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

ALL_CONFIGS = (
    "plain",
    "infinity_none",
    "infinity_cpu",
    "deepspeed_cpu",
    "infinity_nvme",
    "infinity_nvme_param",
    "deepspeed_nvme",
    "deepspeed_nvme_param",
)
# name suffix -> (offload_param.device, offload_optimizer.device)
OFFLOADS = {
    "none": ("none", "none"),
    "cpu": ("cpu", "cpu"),
    "nvme": ("nvme", "nvme"),
    "nvme_param": ("nvme", "cpu"),
}
HYPER = {"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
SEED = 1234

StepFn = Callable[[torch.Tensor, torch.Tensor], dict[str, float]]  # one step -> {"loss", phase seconds}


# -- measuring ---------------------------------------------------------------------------------


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM; ru_maxrss where /proc is missing)."""
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Timer:
    """Accumulates wall time of wrapped callables under names (`wrap(obj, "method", "name")`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, obj: object, attr: str, name: str) -> None:
        inner = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        setattr(obj, attr, timed)

    def take(self) -> dict[str, float]:
        seconds, self.seconds = self.seconds, {}
        return seconds


def phased_step(forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None],
                step: Callable[[], None]) -> dict[str, float]:  # fmt: skip
    """Run forward -> backward -> step, timing each phase."""
    t0 = time.perf_counter()
    loss = forward()
    t1 = time.perf_counter()
    backward(loss)
    t2 = time.perf_counter()
    step()
    t3 = time.perf_counter()
    return {"loss": loss.item(), "forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2}


# -- the configurations (each runs in a child process) -----------------------------------------


def make_plain(model: torch.nn.Module, args: argparse.Namespace, timer: Timer) -> StepFn:
    opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)

    def run(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        opt.zero_grad(set_to_none=True)
        return phased_step(lambda: model(x, y)[1], lambda loss: loss.backward(), opt.step)

    return run


def make_infinity(model: torch.nn.Module, args: argparse.Namespace, timer: Timer, offload: str) -> StepFn:
    import infinity

    param_dev, optim_dev = OFFLOADS[offload]
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {**HYPER, "betas": list(HYPER["betas"])}},
        "bf16": {"enabled": False},
        "zero_optimization": {
            "stage": 3,
            "block_classes": ["Block"],
            "offload_param": {"device": param_dev, "nvme_path": args.nvme_path},
            "offload_optimizer": {"device": optim_dev, "nvme_path": args.nvme_path},
        },
    }
    engine, _, _, _ = infinity.initialize(model=model, config=config)
    for block in (*engine.blocks, engine.root, engine.persistent):
        timer.wrap(block, "start_gather", "gather_s")  # fetch the shard to the device + all-gather (a copy at world 1)
        timer.wrap(block, "release", "release_s")
    timer.wrap(engine.placement, "acquire", "acquire_s")  # the shard's move from its home tier to the device
    timer.wrap(engine.scheduler, "on_block_grads", "reduce_grads_s")  # flat grad, reduce-scatter, accumulate
    timer.wrap(engine.optimizer, "step", "adam_s")

    def run(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        moved, stall = engine.bytes_moved, engine.stall_s  # the engine's counters, cumulative
        out = phased_step(lambda: engine(x, y)[1], engine.backward, engine.step)
        out["stall_s"] = engine.stall_s - stall
        out.update({f"bytes:{pair}": float(n - moved.get(pair, 0)) for pair, n in engine.bytes_moved.items()})
        return out

    return run


def make_deepspeed(model: torch.nn.Module, args: argparse.Namespace, timer: Timer, offload: str) -> StepFn:
    import deepspeed

    param_dev, optim_dev = OFFLOADS[offload]
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {**HYPER, "betas": list(HYPER["betas"])}},
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": param_dev, "nvme_path": args.nvme_path},
            "offload_optimizer": {"device": optim_dev, "nvme_path": args.nvme_path},
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1},
        "steps_per_print": 1_000_000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch.set_num_threads(args.threads)  # in case the accelerator changed it
    return lambda x, y: phased_step(lambda: engine(x, y)[1], engine.backward, engine.step)


def child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build, warm up and time one configuration in this process; returns its JSON record."""
    from infinity.data import ByteBatches, load_corpus
    from infinity.models.gpt import GPT, gpt_preset

    torch.set_flush_denormal(True)  # decaying weights in denormals slow CPU steps several-fold
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    model = GPT(gpt_preset(args.model_size))
    n_params = sum(p.numel() for p in model.parameters())
    timer = Timer()
    start = time.perf_counter()
    if name == "plain":
        run = make_plain(model, args, timer)
    elif name.startswith("infinity_"):
        run = make_infinity(model, args, timer, name.removeprefix("infinity_"))
    elif name.startswith("deepspeed_"):
        run = make_deepspeed(model, args, timer, name.removeprefix("deepspeed_"))
    else:
        raise ValueError(f"unknown configuration {name!r}; choose from {ALL_CONFIGS}")
    init_s = time.perf_counter() - start
    batches = ByteBatches(load_corpus("train"), args.batch, args.seq, seed=SEED)
    records = []
    for i in range(args.warmup + args.steps):
        x, y = next(batches)
        timer.take()
        start, cpu_start = time.perf_counter(), time.process_time()
        rec = run(x, y)
        rec["step_s"] = time.perf_counter() - start
        rec["cpu_s"] = time.process_time() - cpu_start
        rec.update(timer.take())
        records.append(rec)
        print(f"[{name}] step {i} {'warm-up' if i < args.warmup else 'timed'} {rec['step_s']:.3f} s "
              f"loss {rec['loss']:.4f}", flush=True)  # fmt: skip
    timed = records[args.warmup :]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in timed)

    step_s = median("step_s")
    out: dict[str, Any] = {
        "step_s": step_s,
        "tokens_per_s": args.batch * args.seq / step_s,
        "peak_rss_bytes": peak_rss_bytes(),
        "init_s": init_s,
        "model_params": n_params,
        "cpu_s": median("cpu_s"),  # process CPU time per step, all threads: wall >> cpu_s / threads means contention
        "phases_s": {k: median(k) for k in ("forward_s", "backward_s", "optimizer_s")},
        "step_s_min": min(r["step_s"] for r in timed),
        "step_times_s": [r["step_s"] for r in timed],
        "losses": [r["loss"] for r in records],
        "threads": torch.get_num_threads(),
    }
    if name.startswith("infinity_"):
        pairs = sorted({k for r in timed for k in r if k.startswith("bytes:")})
        out["bytes_moved"] = {k.removeprefix("bytes:"): int(median(k)) for k in pairs}
        out["stall_s"] = median("stall_s")
        keys = ("gather_s", "acquire_s", "release_s", "reduce_grads_s", "accumulate_grad_s", "adam_s")
        out["engine_s"] = {k: median(k) for k in keys if any(k in r for r in timed)}
    return out


# -- the parent: one subprocess per configuration ----------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run `name` in a child process, relaying its lines; its record, or {"error": ...}."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if name.startswith("deepspeed_"):
        port = str(free_port())
        env.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--model-size", args.model_size,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--seq", str(args.seq), "--threads", str(args.threads), "--nvme-path", args.nvme_path]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    lines = proc.stdout.strip().splitlines()
    for line in lines[:-1]:
        if line.startswith(f"[{name}]"):
            print(line, flush=True)
    if proc.returncode == 0 and lines:
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(lines[-1])
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
    return {"error": f"exit code {proc.returncode}: {tail}"}


def merge_rounds(records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """One record from several rounds of a config: step times pooled, other figures the median over rounds."""
    ok = [r for r in records if "step_s" in r]
    errors = [r["error"] for r in records if "error" in r]
    if not ok:
        return records[-1]
    if errors:  # a round that failed is left out of the figures but named
        ok[0]["round_errors"] = errors
    if len(ok) == 1:
        return ok[0]

    def med(values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {k: med([v[k] for v in values if k in v]) for k in values[0]}
        if isinstance(values[0], bool) or not isinstance(values[0], (int, float)):
            return values[0]
        m = statistics.median(values)
        return int(m) if isinstance(values[0], int) else m

    merged = {k: med([r[k] for r in ok]) for k in ok[0]}
    merged["step_times_s"] = [t for r in ok for t in r["step_times_s"]]
    merged["step_s"] = statistics.median(merged["step_times_s"])
    merged["step_s_min"] = min(merged["step_times_s"])
    merged["tokens_per_s"] = args.batch * args.seq / merged["step_s"]
    merged["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in ok)
    merged["rounds"] = len(ok)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", default="110m", help="a GPT preset (infinity.models.gpt.GPT_PRESETS)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every child")
    parser.add_argument("--configs", default=",".join(ALL_CONFIGS))
    parser.add_argument("--nvme-path", default=".bench-nvme", help="folder for the NVMe configurations' swap files")
    parser.add_argument("--rounds", type=int, default=1, help="run the configurations this many times, interleaved")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    parser.add_argument("--json", action="store_true", help="(the JSON line is always printed last)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(child(args.child, args)), flush=True)
        return

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {','.join(ALL_CONFIGS)}")
    if importlib.util.find_spec("deepspeed") is None:
        for name in [n for n in names if n.startswith("deepspeed_")]:
            print(f"deepspeed is not importable: skipping {name}")
            names.remove(name)
    os.makedirs(args.nvme_path, exist_ok=True)  # the NVMe configurations' swap files go here

    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_index in range(args.rounds):  # interleaved, so that drifting machine load hits every config alike
        for name in names if round_index % 2 == 0 else names[::-1]:  # alternate order: no config always last
            print(f"== {name} (round {round_index + 1}/{args.rounds})", flush=True)
            rounds[name].append(run_config(name, args))
    results = {name: merge_rounds(records, args) for name, records in rounds.items()}
    plain = results.get("plain", {})
    model_params = next((r["model_params"] for r in results.values() if "model_params" in r), None)
    for name, r in results.items():
        if "step_s" not in r:
            print(f"{name:14s} ERROR {r.get('error', '?')}")
            continue
        r.pop("model_params", None)
        if "step_s" in plain:
            r["ratio_to_plain"] = r["step_s"] / plain["step_s"]
            r["max_loss_diff_to_plain"] = max(abs(a - b) for a, b in zip(r["losses"], plain["losses"], strict=False))
        print(f"{name:14s} {r['step_s']:7.3f} s/step {r['tokens_per_s']:7.1f} tok/s "
              f"rss {r['peak_rss_bytes'] / 2**30:5.2f} GiB ratio {r.get('ratio_to_plain', float('nan')):.3f} "
              f"phases {json.dumps({k: round(v, 3) for k, v in r['phases_s'].items()})}")  # fmt: skip
    summary: dict[str, Any] = {
        "configs": results,
        "model_size": args.model_size,
        "model_params": model_params,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "threads": args.threads,
        "torch": torch.__version__,
        "load_average": os.getloadavg(),  # other processes on the machine skew every figure
    }
    for offload in ("cpu", "nvme", "nvme_param"):  # tokens/s against DeepSpeed with the same offload
        ours, theirs = results.get(f"infinity_{offload}", {}), results.get(f"deepspeed_{offload}", {})
        if "tokens_per_s" in ours and "tokens_per_s" in theirs:
            summary[f"infinity_{offload}_speedup_vs_deepspeed"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
