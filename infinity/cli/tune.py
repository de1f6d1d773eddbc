"""`infinity tune --config cfg.json [--model PRESET] [--budget-minutes M]`: find faster offload settings here.

Short trials of the user's model under the user's config, one setting changed at a time (the prefetch
bucket, the offload buffer counts, aio queue depth, block size and threads; see `infinity.tuning`),
each timed by its median step after a warm-up step. A knob, or a value of it, that changes nothing for
this config and model (a buffer count no budget depends on, see `infinity.tuning.effects`) is not
tried. Prints the trials as a table and writes the fastest config next to the original as
`<stem>.tuned.json`. Runs as one process (world size 1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_BUDGET_MINUTES = 10.0
DEFAULT_TRIAL_STEPS = 6


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    from infinity.cli.arg_types import positive_int, seed
    from infinity.cli.train import DEFAULT_MODEL
    from infinity.models.gpt import GPT_PRESETS
    from infinity.tuning.knobs import ORDER

    parser.add_argument("--config", required=True, help="the DeepSpeed-style JSON config to start from")
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, choices=list(GPT_PRESETS), help=f"GPT preset (default: {DEFAULT_MODEL})"
    )
    parser.add_argument(
        "--budget-minutes",
        type=float,
        default=DEFAULT_BUDGET_MINUTES,
        help=f"start no trial after this long (default: {DEFAULT_BUDGET_MINUTES:g})",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_TRIAL_STEPS,
        help=f"optimizer steps per trial, the first one untimed (default: {DEFAULT_TRIAL_STEPS})",
    )
    parser.add_argument(
        "--knobs", help="comma-separated subset to search (default: all that apply): " + ", ".join(ORDER)
    )
    parser.add_argument("--seq", type=positive_int, help="tokens per sequence, as `infinity train --seq`")
    parser.add_argument("--nvme-path", help="folder for the trials' NVMe swap files (default: the config's)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="compute dtype, as `infinity train --dtype`")
    parser.add_argument("--out", help="where to write the tuned config (default: <config stem>.tuned.json beside it)")
    parser.add_argument("--work-dir", help="keep the trials' configs, log and trace here (default: a temporary folder)")
    parser.add_argument(
        "--fresh-process", action="store_true", help="start a new process for every trial (slower, more isolated)"
    )
    parser.add_argument("--seed", type=seed, default=1234, help="random seed, as `infinity train --seed`")


def tuned_path(config: str | Path) -> Path:
    """`<dir>/<stem>.tuned.json` for the config file `config`."""
    path = Path(config)
    return path.with_name(f"{path.stem}.tuned.json")


def _block_plan(model_name: str, seq: int | None, cfg):
    """The model's blocks as the engine will plan them (the model built on the meta device)."""
    import torch

    from infinity.cli.train import DEFAULT_SEQ
    from infinity.models.gpt import GPT, gpt_preset
    from infinity.partition import plan_blocks

    preset = gpt_preset(model_name)
    with torch.device("meta"):
        model = GPT(gpt_preset(model_name, block_size=min(seq or DEFAULT_SEQ, preset.block_size)))
    z = cfg.zero_optimization
    return plan_blocks(model, z.block_classes, z.block_size_elems, z.stage3_param_persistence_threshold)


def _effective(names: list[str], knobs: dict, cfg, plan) -> list:
    """The knobs of `names` that change something here, each with only the values that do; notes on stderr."""
    from infinity.engine.setup import compute_device
    from infinity.tuning.effects import effective_knob

    kept = []
    for name in names:
        knob, why = effective_knob(knobs[name], cfg, plan, compute_device())
        if knob is None:
            print(f"infinity tune: {why}", file=sys.stderr)
        else:
            kept.append(knob)
    return kept


def _job(args: argparse.Namespace, work_dir: Path):
    """The TuneJob for `args`; ConfigError / ValueError say what is wrong with them."""
    from infinity.cli.train import build_config
    from infinity.config import ConfigError, load_config
    from infinity.models.gpt import gpt_preset
    from infinity.tuning.knobs import PREFETCH, all_knobs, applicable, select
    from infinity.tuning.tuner import TuneJob

    if args.steps < 2:
        raise ConfigError("--steps must be >= 2: the first step of a trial is a warm-up and is not timed")
    if args.budget_minutes <= 0:
        raise ConfigError("--budget-minutes must be > 0")
    block_size = gpt_preset(args.model).block_size
    if args.seq is not None and args.seq > block_size:  # as `infinity train` refuses it, before any trial
        raise ConfigError(f"--seq {args.seq} exceeds the '{args.model}' preset's block_size {block_size}")
    load_config(args.config)  # the file's own errors (missing, not JSON, bad keys), named, before anything runs
    raw = json.loads(Path(args.config).read_text())
    ns = argparse.Namespace(config=raw, offload=None, nvme_path=args.nvme_path, dtype=args.dtype, steps=args.steps)
    cfg = build_config(ns, gpt_preset(args.model).n_embd)
    resolved = cfg.to_dict()
    plan = _block_plan(args.model, args.seq, cfg)
    block_elems = max((sum(p.numel() for _, p, _ in uses) for _, _, uses in plan.blocks), default=0)
    knobs = all_knobs(max(block_elems, 1))
    names = select(applicable(resolved), args.knobs)
    if block_elems == 0 and PREFETCH in names:
        names.remove(PREFETCH)
        print(
            "infinity tune: not tuning the prefetch bucket: every parameter is below "
            "stage3_param_persistence_threshold, so no block is fetched",
            file=sys.stderr,
        )
    chosen = _effective(names, knobs, cfg, plan)
    if not chosen:
        why = f"--knobs {args.knobs} do not apply to this config" if args.knobs else "nothing is offloaded to NVMe"
        raise ConfigError(f"no knob to tune: {why} (buffer counts and aio settings apply only with NVMe offload)")
    return TuneJob(
        raw=raw,
        resolved=resolved,
        knobs=chosen,
        model=args.model,
        steps=args.steps,
        budget_s=args.budget_minutes * 60,
        work_dir=work_dir,
        block_elems=block_elems,
        seq=args.seq,
        nvme_path=args.nvme_path,
        dtype=args.dtype,
        seed=args.seed,
        fresh_process=args.fresh_process,
    )


def _train_command(args: argparse.Namespace, out: Path) -> str:
    cmd = ["infinity", "train", "--config", str(out), "--model", args.model]
    for flag, value in (("--seq", args.seq), ("--nvme-path", args.nvme_path), ("--dtype", args.dtype)):
        if value is not None:
            cmd += [flag, str(value)]
    return " ".join(cmd)


def run_tune(args: argparse.Namespace) -> int:
    """Tune per `args`; 0 when a tuned config was written, 1 when the baseline failed, 2 for bad input."""
    from infinity.cli.preflight import write_problem
    from infinity.config import ConfigError
    from infinity.tuning.report import describe_changes, format_table
    from infinity.tuning.tuner import Tuner, tuned_config

    out = Path(args.out) if args.out else tuned_path(args.config)
    for flag, path, folder in (("--out", out, False), ("--work-dir", Path(args.work_dir or "."), True)):
        problem = write_problem(path, folder)
        if problem:  # found before the trials, not after them
            print(f"infinity tune: {flag} '{path}' {problem}", file=sys.stderr)
            return 2
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="infinity-tune-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        try:
            job = _job(args, work_dir)
        except (ConfigError, ValueError, KeyError) as exc:
            print(f"infinity tune: {exc}", file=sys.stderr)
            return 2
        print(
            f"infinity tune: GPT '{args.model}' under {args.config}; {args.steps} steps per trial (median of the "
            f"last {args.steps - 1}), budget {args.budget_minutes:g} min; knobs: "
            + ", ".join(k.name for k in job.knobs),
            flush=True,
        )
        outcome = Tuner(job, say=lambda line: print(line, flush=True)).run()
        search = outcome.search
        if search.baseline.result.error is not None:
            print(f"infinity tune: the config as given does not train: {search.baseline.result.error}", file=sys.stderr)
            return 1
        print()
        print(format_table(search))
        print()
        for note in outcome.notes:
            print(f"note: {note}")
        noise = f"gains under {search.threshold:.0%} counted as noise"
        if outcome.best == outcome.start:
            print(f"best: the config as given; no change was faster beyond the noise ({noise})")
        else:
            speedup = search.baseline.median_s / search.best.median_s
            print(
                f"best: {describe_changes(outcome.start, outcome.best)}; median step {search.best.median_s:.4f} s "
                f"vs {search.baseline.median_s:.4f} s as given ({speedup:.2f}x; {noise})"
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(tuned_config(job.raw, job.knobs, outcome.start, outcome.best), indent=2) + "\n")
        print(f"wrote {out}")
        print(f"train with it: {_train_command(args, out)}")
        return 0
    finally:
        if not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
