"""Scratch folders for swap files: one per run, removed at the end, on errors and on SIGTERM/SIGINT/SIGHUP.

A folder is named `<prefix><pid>`; folders whose process is gone (a run killed with SIGKILL) are
removed by the next run that looks in the same place.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def install_signal_handlers(on_signal: Callable[[], None] | None = None) -> None:
    """SIGTERM/SIGHUP/SIGINT raise SystemExit (after `on_signal()`), so `finally` blocks remove swap files."""

    def handler(signum: int, _frame: Any) -> None:
        if on_signal is not None:
            on_signal()
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # keep nohup's SIGHUP ignored
            signal.signal(sig, handler)


def remove_stale_dirs(base: Path, prefix: str) -> list[Path]:
    """Remove `<base>/<prefix><pid>` folders whose process is gone; returns those removed."""
    removed = []
    for folder in base.glob(prefix + "*"):
        try:
            pid = int(folder.name[len(prefix) :])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            print(f"removing {folder}, left by a killed run (pid {pid})", file=sys.stderr, flush=True)
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        except PermissionError:
            continue
    return removed


@contextmanager
def scratch_dir(base: Path, prefix: str) -> Iterator[Path]:
    """`<base>/<prefix><this pid>`, created empty and removed with everything in it when the block ends."""
    folder = base / f"{prefix}{os.getpid()}"
    folder.mkdir(parents=True)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
