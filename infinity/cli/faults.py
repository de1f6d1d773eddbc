"""How the `infinity` command ends on an error: one line naming the thing and what to do, and an exit code
per class of cause. A bug in infinity itself still ends in a traceback (exit code 1); `--debug` or
INFINITY_DEBUG=1 prints the traceback for the others too.
"""

from __future__ import annotations

import enum
import errno
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

DEBUG_ENV = "INFINITY_DEBUG"


class ExitCode(enum.IntEnum):
    OK = 0
    INTERNAL = 1
    USAGE = 2
    PATH = 3
    DISK_FULL = 4
    SWAP_FILE = 5
    CHECKPOINT = 6
    PEER = 7
    MEMORY = 8


EXIT_CODES_HELP = """\
exit codes:
  0    success
  1    internal error: a bug in infinity (a traceback is printed; please report it)
  2    usage or config: a bad flag, config file, key or value
  3    a path: missing, a file where a folder belongs, not writable (permissions, read-only)
  4    disk full while writing swap, a checkpoint or an output file
  5    swap file: used by another live run, a foreign file in the way, or damaged
  6    checkpoint: missing, incomplete, damaged, or from another model or run; a damaged model folder
  7    peer: another rank died, stopped or hung, or the rendezvous store stopped answering
  8    memory: a memory budget cannot hold what the run needs
  130  interrupted by SIGINT (Ctrl-C); 143: by SIGTERM
Every error but 1 is one line on stderr; --debug (or INFINITY_DEBUG=1) adds the traceback."""

_PATH_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EACCES, errno.EPERM, errno.EROFS}
_PATH_ERRNOS |= {errno.ENAMETOOLONG, errno.ELOOP}
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_ADVICE = {
    errno.EROFS: "choose a folder on a writable filesystem",
    errno.EACCES: "fix its permissions or choose another folder",
    errno.EPERM: "fix its permissions or choose another folder",
    errno.ENOSPC: "free space there or choose another disk",
    errno.EDQUOT: "free space within your quota or choose another disk",
    errno.EFBIG: "the file is over this process's or filesystem's file-size limit; choose another disk",
    errno.ENOENT: "check the path",
}


class CommandError(Exception):
    """A user error the command found itself: its message is the line to print, `code` the exit code."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Interrupted(BaseException):
    """A terminating signal, raised in the main thread so that finally blocks and atexit cleanups run."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass(frozen=True)
class Fault:
    code: int
    message: str


class _PeerSilence:
    """Set by the heartbeat's watch thread; tells the main thread why it was interrupted."""

    message: str | None = None
    reported = threading.Event()


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _os_message(exc: OSError) -> str:
    text = exc.strerror or str(exc)
    if exc.filename is not None and str(exc.filename) not in text:
        text = f"'{exc.filename}': {text}"
    advice = _ADVICE.get(exc.errno or 0)
    if advice and "; " not in text:
        text += f"; {advice}"
    return text


def classify(exc: BaseException) -> Fault | None:
    """The exit code and message for a user error or an interruption; None for an internal error (a bug)."""
    from infinity.comm import CommError
    from infinity.config import ConfigError
    from infinity.data.text import DataError
    from infinity.engine.checkpoint import CheckpointError
    from infinity.models.weight_files import DamagedFileError
    from infinity.storage.errors import BudgetError, StorageError, SwapFileError

    if isinstance(exc, CommandError):
        return Fault(exc.code, str(exc))
    if isinstance(exc, Interrupted):
        return Fault(128 + exc.signum, f"interrupted by {exc}")
    if isinstance(exc, KeyboardInterrupt):
        if _PeerSilence.message is not None:
            return Fault(ExitCode.PEER, _PeerSilence.message)
        return Fault(128 + signal.SIGINT, "interrupted by SIGINT")
    if isinstance(exc, (ConfigError, DataError)):
        return Fault(ExitCode.USAGE, str(exc))
    if isinstance(exc, ImportError) and "pip install" in str(exc):  # an optional extra the run needs
        return Fault(ExitCode.USAGE, str(exc))
    if isinstance(exc, (CheckpointError, DamagedFileError)):
        return Fault(ExitCode.CHECKPOINT, str(exc))
    if isinstance(exc, CommError):
        return Fault(ExitCode.PEER, str(exc))
    if isinstance(exc, BudgetError):
        text = str(exc)
        if "zero_optimization" not in text:
            text += " (the budgets are zero_optimization.host_budget_bytes and device_budget_bytes)"
        return Fault(ExitCode.MEMORY, text)
    if isinstance(exc, SwapFileError):
        return Fault(ExitCode.SWAP_FILE, _os_message(exc))
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        return Fault(ExitCode.DISK_FULL, _os_message(exc))
    if isinstance(exc, OSError) and exc.errno in _PATH_ERRNOS:
        return Fault(ExitCode.PATH, _os_message(exc))
    if isinstance(exc, StorageError):
        return Fault(ExitCode.SWAP_FILE, _os_message(exc))
    return None


def debug_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """Whether `--debug` is among `argv` or INFINITY_DEBUG is set; `argv` without `--debug`."""
    rest = [a for a in argv if a != "--debug"]
    return len(rest) != len(argv) or os.environ.get(DEBUG_ENV, "") not in ("", "0"), rest


def _prefix(command: str) -> str:
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    rank = f"rank {os.environ.get('RANK', '?')}: " if world > 1 else ""
    return f"infinity {command}: {rank}"


def report(command: str, message: str) -> None:
    """Print `message` as the command's one error line on stderr."""
    prefix = _prefix(command)
    if message.startswith(f"rank {os.environ.get('RANK')}/"):  # it names the rank already (a CommError)
        prefix = f"infinity {command}: "
    print(prefix + _one_line(message), file=sys.stderr, flush=True)


def raise_on_terminate(signum: int, _frame) -> None:
    raise Interrupted(signum)


def guarded(command: str, body: Callable[[], int], debug: bool) -> int:
    """Run `body` (a command); a user error or an interruption becomes one line on stderr and its exit code.

    SIGTERM (like SIGINT) is raised in the main thread as an exception, so finally blocks and atexit
    cleanups (swap files, an unfinished checkpoint) run before the process ends.
    """
    _PeerSilence.message = None
    _PeerSilence.reported.clear()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, raise_on_terminate)
    try:
        return body()
    except (Exception, KeyboardInterrupt, Interrupted) as exc:
        if previous is not None:  # torchrun SIGTERMs the other ranks when one dies: this error is the report
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        fault = classify(exc)
        if fault is None:
            raise  # a bug: the traceback is the report
        if debug:
            traceback.print_exc()
        if not _PeerSilence.reported.is_set():
            _PeerSilence.reported.set()
            report(command, fault.message)
        return fault.code
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def on_peer_silent(command: str) -> Callable[[str], None]:
    """The heartbeat's `on_silent` for `command`: end the run with ExitCode.PEER and the one-line message."""
    from infinity.comm import end_process

    def silent(message: str) -> None:
        _PeerSilence.message = message

        def last_words() -> None:
            if not _PeerSilence.reported.is_set():
                _PeerSilence.reported.set()
                report(command, message)

        end_process(ExitCode.PEER, last_words, main_is_exiting=_PeerSilence.reported.is_set)

    return silent
