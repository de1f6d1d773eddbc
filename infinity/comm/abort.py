"""Ending the process from a watchdog thread, with the cleanups a normal exit runs (swap files, staging).

The main thread may be blocked inside a collective, where no Python signal handler runs until the
collective times out. So: interrupt the main thread (a KeyboardInterrupt where it runs Python), give it
`grace_s` to unwind and exit by itself (its finally blocks and atexit handlers run), and otherwise run
the atexit handlers here, bounded by `cleanup_timeout_s`, and leave with `os._exit`.
"""

from __future__ import annotations

import _thread
import atexit
import os
import sys
import threading
import time
from collections.abc import Callable


def end_process(
    exit_code: int,
    last_words: Callable[[], None] | None = None,
    main_is_exiting: Callable[[], bool] | None = None,
    grace_s: float = 5.0,
    cleanup_timeout_s: float = 30.0,
) -> None:
    """From a thread other than the main one: end the process with `exit_code` (see the module doc).

    `last_words` runs just before a forced exit (it prints what the main thread would have said);
    while `main_is_exiting()` is true the main thread has unwound and runs its own cleanups, which get
    up to `cleanup_timeout_s` more before the exit is forced. Returns at once if called from the main
    thread (the KeyboardInterrupt follows).
    """
    _thread.interrupt_main()
    if threading.current_thread() is threading.main_thread():
        return
    time.sleep(grace_s)  # normally the process ends during this sleep
    if main_is_exiting is not None and main_is_exiting():
        time.sleep(cleanup_timeout_s)
        os._exit(exit_code)
    if last_words is not None:
        last_words()
    cleanup = threading.Thread(target=atexit._run_exitfuncs, name="infinity-exit-cleanup", daemon=True)
    cleanup.start()
    cleanup.join(cleanup_timeout_s)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(exit_code)
