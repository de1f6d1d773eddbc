"""The `infinity` command (also `python -m infinity`).

infinity [train] [...]            train (the embedded default job with no arguments)
infinity config [FILE] [...]      print a config resolved as `infinity train` would, every default filled in;
                                  on stderr, whether its stage and offload fit this machine (and a note)
infinity consolidate CKPT OUT     write one full fp32 state dict from a sharded checkpoint
infinity estimate --params N      memory per ZeRO stage and offload, what fits here, the largest model that fits
infinity profile TRACE... [--out DIR]   summarize and diagnose swap traces (`infinity train --profile`)
infinity tune --config FILE [...] try offload settings in short trials, write the fastest as FILE's .tuned.json

A user error (config, paths, disk full, a busy swap file, a bad checkpoint, a peer that died or
stopped) ends in one line on stderr and an exit code per cause (`infinity.cli.faults`); `--debug`
or INFINITY_DEBUG=1 adds the traceback. A bug in infinity ends in a traceback and exit code 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

COMMANDS = ("train", "config", "consolidate", "estimate", "profile", "tune")


class _OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose refusal of a flag is one line on stderr (exit code 2), as every other user error
    is, instead of the usage block and then the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    from infinity.cli import estimate
    from infinity.cli.faults import EXIT_CODES_HELP
    from infinity.cli.train import DEFAULT_MODEL, DEFAULT_STEPS, add_train_arguments

    parser = _OneLineParser(
        prog="infinity",
        description="Train models larger than your hardware.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--debug", action="store_true", help="print the traceback of an error too (any command; or INFINITY_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command")
    add_train_arguments(sub.add_parser("train", help="train a GPT (the default job with no arguments)"))

    config = sub.add_parser("config", help="print a config resolved with every default filled in")
    config.add_argument("file", nargs="?", help="a DeepSpeed-style JSON config (default: the embedded one)")
    config.add_argument("--world-size", type=int, default=1, help="ranks (on this node), for the batch-size arithmetic "
                        "and the fit line")  # fmt: skip
    config.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f'{estimate.MODEL_HELP} (default: {DEFAULT_MODEL}): its hidden size resolves "auto", its layers are '
        "the blocks where the config names none, and the fit line estimates its size",
    )
    config.add_argument("--steps", type=int, default=DEFAULT_STEPS, help='resolves "auto" scheduler steps')
    config.add_argument("--offload", choices=("none", "cpu", "nvme"))
    config.add_argument("--nvme-path")
    config.add_argument("--dtype", choices=("fp32", "bf16", "fp16"))

    cons = sub.add_parser("consolidate", help="write one full fp32 state dict from a sharded checkpoint")
    cons.add_argument("checkpoint", help="a --save-dir (its latest checkpoint) or one checkpoint folder")
    cons.add_argument("out", help="output file: .pt/.bin (torch) or .safetensors")
    cons.add_argument("--tag", help="the checkpoint to use instead of the latest")
    cons.add_argument("--format", choices=("torch", "safetensors"), help="default: from OUT's suffix")
    cons.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (refused otherwise)")

    estimate.add_arguments(sub.add_parser("estimate", help="memory needed at each ZeRO stage and offload choice"))

    from infinity.cli.tune import add_tune_arguments
    from infinity.profiler.cli import add_profile_arguments

    add_profile_arguments(sub.add_parser("profile", help="summarize and diagnose swap traces"))
    add_tune_arguments(sub.add_parser("tune", help="find faster offload settings for this machine in short trials"))
    return parser


def _config(args: argparse.Namespace) -> int:
    from infinity.cli.estimate import config_fit_line, meta_model
    from infinity.cli.train import build_config
    from infinity.config import ConfigError, resolve_batch_sizes

    if args.world_size < 1:  # before the batch-size arithmetic divides by it
        raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
    args.config = args.file
    model = meta_model(args.model)
    cfg = build_config(args, model.hidden_size, model.block_classes)
    cfg = resolve_batch_sizes(cfg, args.world_size)
    print(json.dumps(cfg.to_dict(), indent=2))
    print(config_fit_line(cfg, model, args.world_size), file=sys.stderr)  # stdout stays the JSON
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from infinity.engine.checkpoint import resolve_folder
    from infinity.engine.consolidate import consolidate
    from infinity.estimator import format_bytes

    folder = resolve_folder(args.checkpoint, args.tag, tag_hint="name one with --tag TAG")
    result = consolidate(folder, args.out, fmt=args.format, overwrite=args.overwrite)
    print(
        f"wrote {result.path} ({result.format}): {result.tensors} tensors, {result.parameters:,} parameters, "
        f"{format_bytes(result.bytes)}"
    )
    return 0


def console_main() -> int:
    """The `infinity` command as a process: `main`, free to restart itself once where its training run would
    have malloc return memory to the OS, so that glibc asks for transparent huge pages (see
    `infinity.engine.host_memory`)."""
    return main(may_restart=True)


def main(argv: list[str] | None = None, may_restart: bool = False) -> int:
    """Run the command `argv` names; its exit code (see `infinity --help`)."""
    from infinity.cli.faults import debug_requested, guarded

    debug, argv = debug_requested(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv.insert(0, "train")  # `infinity`, `infinity --steps 10`: the train command
    args = _parser().parse_args(argv)
    args.may_restart = may_restart  # an in-process caller (a test, a notebook) is never replaced
    with _notices_as_lines(args.command):
        return guarded(args.command, lambda: _run(args), debug)


@contextlib.contextmanager
def _notices_as_lines(command: str) -> Iterator[None]:
    """infinity's own warnings print as one line, "infinity train: note: ...", not as a source path, a line
    number and "UserWarning:" (a stale swap file removed, a key with no effect); others' as Python prints them."""
    package = str(Path(__file__).resolve().parents[1]) + os.sep
    python_shows = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if str(filename).startswith(package):
            print(f"infinity {command}: note: {message}", file=sys.stderr if file is None else file)
        else:
            python_shows(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = python_shows


def _run(args: argparse.Namespace) -> int:
    if args.command == "train":
        from infinity.cli.train import run_train

        return run_train(args)
    if args.command == "config":
        return _config(args)
    if args.command == "consolidate":
        return _consolidate(args)
    if args.command == "profile":
        from infinity.profiler.cli import run_profile

        return run_profile(args)
    if args.command == "tune":
        from infinity.cli.tune import run_tune

        return run_tune(args)
    from infinity.cli.estimate import run

    return run(args)
