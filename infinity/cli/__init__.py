"""The `infinity` command: `infinity train`, `infinity config FILE`."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="infinity", description="Train models larger than your hardware.")
    sub = parser.add_subparsers(dest="command")
    from infinity.cli.train import add_train_arguments

    add_train_arguments(sub.add_parser("train", help="train a GPT (the default job with no arguments)"))
    config_parser = sub.add_parser("config", help="print a config resolved with every default filled in")
    config_parser.add_argument("file")
    config_parser.add_argument("--world-size", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command in (None, "train"):
        from infinity.cli.train import run_train

        if args.command is None:
            args = parser.parse_args(["train"])
        return run_train(args)
    if args.command == "config":
        from infinity.config import ConfigError, load_config, resolve_batch_sizes

        try:
            cfg = resolve_batch_sizes(load_config(args.file), args.world_size)
        except ConfigError as exc:
            print(f"infinity config: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    parser.error(f"unknown command {args.command}")
    return 2
