"""argparse `type=` functions for the commands' numeric flags: a value out of range is refused while the
arguments are parsed, argparse's error line naming the flag, the range and the value (exit code 2)."""

from __future__ import annotations

import argparse

SEED_MAX = 2**63 - 1  # torch.manual_seed takes up to 2**64 - 1; the data order's generators take < 2**63


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """`text` as an integer >= 1; argparse.ArgumentTypeError otherwise."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def seed(text: str) -> int:
    """`text` as a random seed, an integer in [0, 2**63 - 1]; argparse.ArgumentTypeError otherwise."""
    value = _integer(text)
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63 - 1] = [0, {SEED_MAX}], got {value}")
    return value
