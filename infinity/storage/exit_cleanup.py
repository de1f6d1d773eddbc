"""Live swap files are removed however the process ends, short of SIGKILL.

A normal exit, an uncaught exception or KeyboardInterrupt run Python's exit handlers (each
`NvmeFile` closes itself there). A signal whose action is the default ends the process without
them: for SIGTERM, SIGHUP and SIGINT at their default action, a native handler removes this
process's registered files at delivery (even while the main thread is blocked in a collective or a
disk wait) and re-raises, so the process ends with that signal's status. A handler the program
installed, or an ignored signal, is left alone. What SIGKILL leaves is removed by the next store on
the same path (see `NvmeFile`).
"""

from __future__ import annotations

import functools
import os
import signal

TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


@functools.cache
def _native():
    from infinity._native_loader import load_native

    return load_native().exit_cleanup


def handled_signals() -> list[signal.Signals]:
    """Install the removal handler where a terminating signal still has its default action; those it handles."""
    return [signal.Signals(s) for s in _native().install([int(s) for s in TERMINATING_SIGNALS])]


def register_live_file(path: str, fd: int) -> int:
    """Remove `path` if a default-action signal ends this process while it still names `fd`'s inode.

    Returns a token for `unregister_live_file` (-1 when the registry is full: the file then still
    goes at a normal exit, and the next run removes it).
    """
    handled_signals()
    st = os.fstat(fd)
    return _native().register_file(os.path.abspath(path), st.st_dev, st.st_ino)


def unregister_live_file(token: int) -> None:
    _native().unregister_file(token)
