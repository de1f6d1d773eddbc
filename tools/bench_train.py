"""Benchmarks training steps of the project's GPT on the path users run: infinity beside DDP, FSDP2 and DeepSpeed.

Every configuration (benchlib/trainers.py lists them: plain, ddp, fsdp2_none|cpu,
deepspeed_z3_none|cpu|nvme|nvme_param, deepspeed_z2_none|cpu, infinity_z3_none|cpu|nvme|nvme_param,
infinity_z2_none|cpu|nvme) trains the same model (preset, seed) on the same global batches of the
shipped corpus for `--warmup` untimed then `--steps` timed steps, in its own processes: `--nproc`
ranks under torchrun with `--threads` threads each (default 1; with --nproc 1, one process of 2
threads), plain PyTorch in one process with nproc x threads threads. `--batch` is the global batch;
each rank takes its 1/nproc slice. The configurations run in alternating order over `--rounds`.
A configuration that fails (e.g. a stage the engine does not support yet) reports its error and
the run goes on.

Per configuration (the JSON's "configs"):
  step_s, step_s_min, step_times_s   median / min / all timed steps (a step lasts as long as its slowest rank)
  tokens_per_s                       global batch x seq / step_s
  ratio_to_ddp, ratio_to_plain       step_s over DDP's / plain's in the same run
  best_peer, ratio_to_best_peer      infinity rows: the fastest FSDP2 or DeepSpeed row with the same ZeRO stage
                                     and the same offload (FSDP2 counts as stage 3), and step_s over its step_s
  losses, max_loss_diff_to_plain     loss per step (mean over ranks = the global batch's loss), all steps
  phases_s                           rank 0's median wall time in forward / backward / optimizer step
  rss_at_start_bytes, rss_after_build_bytes, rss_after_setup_bytes, rss_after_steps_bytes
                                     per rank VmRSS after imports, after building the model, after wrapping it
                                     (engine/optimizer built), after all steps
  peak_rss_after_setup_bytes, peak_rss_bytes, max_peak_rss_bytes
                                     per rank VmHWM after setup and at the end; the largest rank's
  cpu_s                              per rank CPU time per step (all threads): wall >> cpu_s / threads is contention
  sys_s, page_faults                 per rank, median per step: of cpu_s, the time in the kernel, and the minor
                                     page faults (first touches of memory taken from the OS: their zeroing is most
                                     of sys_s)
  init_s                             seconds to wrap the model (slowest rank)
  bytes_moved, stall_s               infinity, per rank, median per timed step of the engine's public counters
                                     (engine.bytes_moved per "from->to" pair, engine.stall_s)
  kept_buffer_bytes                  infinity, per rank after all steps: host memory kept between uses for
                                     gathers, reductions and held gradients (engine.kept_buffer_bytes; part of
                                     rss_after_steps_bytes)
  engine_s                           with --engine-timers only: rank 0's time inside engine internals
                                     (benchlib.trainers.instrument_engine_internals)

`--huge-pages on` starts every process, peers included, with GLIBC_TUNABLES=glibc.malloc.hugetlb=1
(see infinity.engine.host_memory); by default none has it, as the infinity command starts a run that
sets no host budget.

Compare configurations within one run only: this machine's memory bandwidth drifts over time.

    python tools/bench_train.py [--model-size 110m] [--nproc 2] [--dtype fp32|bf16] [--clip 0|1.0]
                                [--steps 4] [--warmup 2] [--batch 4] [--seq 256] [--configs a,b,...] [--rounds 1]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from benchlib.launch import kill_running, merge_rounds, run_configuration
from benchlib.scratch import install_signal_handlers, remove_stale_dirs, scratch_dir
from benchlib.trainers import CONFIGS, resolve_names

from infinity.engine.host_memory import huge_pages_environment, without_huge_pages

SEED = 1234
SCRATCH_PREFIX = ".bench-train-"
PEER_FRAMEWORKS = ("fsdp2", "deepspeed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-size", default="110m", help="a GPT preset (infinity.models.gpt.GPT_PRESETS)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks of every distributed configuration")
    parser.add_argument("--threads", type=int, default=None, help="threads per rank (default: 2 at --nproc 1, else 1)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--clip", type=float, default=0.0, help="gradient clipping by global norm (0: off)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences per step over all ranks)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names (see above)")
    parser.add_argument("--nvme-path", default=".", help="folder whose disk holds the NVMe configurations' swap files")
    parser.add_argument("--rounds", type=int, default=1, help="run the configurations this many times, interleaved")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    parser.add_argument("--huge-pages", choices=("on", "off"), default="off",
                        help="on: every configuration's processes start with glibc's malloc asking for transparent "
                        "huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1); off (the default, as the infinity "
                        "command starts runs without a host budget): none does")  # fmt: skip
    parser.add_argument("--engine-timers", action="store_true", help="also time infinity's internals (see engine_s)")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="infinity configurations record swap traces of their timed steps into "
                        "DIR/<config> (DIR/<config>-round<k> with --rounds > 1); read them with "
                        "`infinity profile DIR/<config>`")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="(the JSON line is always printed last)")
    args = parser.parse_args(argv)
    if args.threads is None:
        args.threads = 2 if args.nproc == 1 else 1
    try:
        args.names = resolve_names([n.strip() for n in args.configs.split(",") if n.strip()])
    except ValueError as exc:
        parser.error(str(exc))
    if args.nproc < 1 or args.batch % args.nproc:
        parser.error(f"--batch {args.batch} must be a positive multiple of --nproc {args.nproc}")
    return args


def base_spec(args: argparse.Namespace) -> dict[str, Any]:
    """What every configuration's child is told (launch adds its name, record and NVMe folders)."""
    return {
        "model_size": args.model_size,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "dtype": args.dtype,
        "clip": args.clip,
        "seed": SEED,
        "engine_timers": args.engine_timers,
    }


def profile_dir(args: argparse.Namespace, name: str, round_index: int) -> str | None:
    """Where configuration `name` records its swap traces in round `round_index` (infinity only; None: off)."""
    if args.profile is None or CONFIGS[name].framework != "infinity":
        return None
    leaf = name if args.rounds == 1 else f"{name}-round{round_index + 1}"
    return str(Path(args.profile).resolve() / leaf)


def add_comparisons(results: dict[str, dict[str, Any]]) -> None:
    """ratio_to_plain, ratio_to_ddp, loss differences, and for infinity rows the best same-offload peer."""
    plain, ddp = results.get("plain", {}), results.get("ddp", {})
    for name, r in results.items():
        if "step_s" not in r:
            continue
        if "step_s" in plain:
            r["ratio_to_plain"] = r["step_s"] / plain["step_s"]
            r["max_loss_diff_to_plain"] = max(abs(a - b) for a, b in zip(r["losses"], plain["losses"], strict=False))
        if "step_s" in ddp:
            r["ratio_to_ddp"] = r["step_s"] / ddp["step_s"]
        cfg = CONFIGS[name]
        if cfg.framework != "infinity":
            continue
        peers = {
            n: p
            for n, p in results.items()
            if "step_s" in p and CONFIGS[n].framework in PEER_FRAMEWORKS and CONFIGS[n].peer_key == cfg.peer_key
        }
        if peers:
            best = min(peers, key=lambda n: peers[n]["step_s"])
            r["best_peer"], r["ratio_to_best_peer"] = best, r["step_s"] / peers[best]["step_s"]


def print_table(results: dict[str, dict[str, Any]]) -> None:
    nan = float("nan")
    for name, r in results.items():
        if "step_s" not in r:
            print(f"{name:24s} ERROR {r.get('error', '?').splitlines()[0][:300]}")
            continue
        peer = f"{r['ratio_to_best_peer']:.3f} vs {r['best_peer']}" if "best_peer" in r else "-"
        print(f"{name:24s} {r['step_s']:7.3f} s/step {r['tokens_per_s']:8.1f} tok/s"
              f"  /ddp {r.get('ratio_to_ddp', nan):.3f}  /peer {peer}"
              f"  peak rss {r['max_peak_rss_bytes'] / 2**30:5.2f} GiB"
              f"  loss diff {r.get('max_loss_diff_to_plain', nan):.2e}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = list(args.names)
    if importlib.util.find_spec("deepspeed") is None:
        for name in [n for n in names if CONFIGS[n].framework == "deepspeed"]:
            print(f"deepspeed is not importable: skipping {name}", file=sys.stderr)
            names.remove(name)
    install_signal_handlers(on_signal=kill_running)
    # the same environment for every configuration, peers included: it is the process's, not infinity's
    env = dict(os.environ)
    env = (huge_pages_environment(env) or env) if args.huge_pages == "on" else without_huge_pages(env)
    os.environ.clear()
    os.environ.update(env)
    base = Path(args.nvme_path).resolve()
    remove_stale_dirs(base, SCRATCH_PREFIX)
    spec = base_spec(args)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with scratch_dir(base, SCRATCH_PREFIX) as workdir:
        for round_index in range(args.rounds):  # interleaved: drifting machine load hits every config alike
            for name in names if round_index % 2 == 0 else names[::-1]:  # alternate: no config always last
                print(f"== {name} (round {round_index + 1}/{args.rounds})", flush=True)
                threads = args.threads * (args.nproc if not CONFIGS[name].distributed else 1)
                run = {**spec, "name": name, "threads": threads, "profile_dir": profile_dir(args, name, round_index)}
                rounds[name].append(run_configuration(run, args.nproc, workdir, args.timeout))
    results = {name: merge_rounds(records, spec) for name, records in rounds.items()}
    add_comparisons(results)
    print_table(results)
    model_params = next((r["model_params"] for r in results.values() if "model_params" in r), None)
    summary = {
        "configs": results,
        "model_size": args.model_size,
        "model_params": model_params,
        "nproc": args.nproc,
        "threads_per_rank": args.threads,
        "dtype": args.dtype,
        "clip": args.clip,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),  # other processes on the machine skew every figure
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
