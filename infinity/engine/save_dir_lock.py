"""One live run per save folder: a flock on the folder itself, held while a run (an engine, the CLI) saves there.

Two runs saving into one folder replace each other's checkpoints and staging folders. Rank 0 takes the lock
(`hold_save_dir`) before it stages a checkpoint, and `infinity train` before it trains; the holder lets go
(`release_save_dirs`) when it ends, and the kernel drops the lock when the process ends, however it ends.
"""

from __future__ import annotations

import os
from pathlib import Path

from infinity.engine.checkpoint_errors import CheckpointError

_held_locks: dict[Path, tuple[int, set[object]]] = {}  # folders this process holds: descriptor, holders


def _close_held_in_child() -> None:
    """A forked child (a DataLoader worker) shares the parent's open folders, and with them the locks: it
    closes its copies, so that the lock ends with the run, not with the last worker (never LOCK_UN: that
    would unlock the parent too)."""
    for fd, _ in _held_locks.values():
        os.close(fd)
    _held_locks.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def hold_save_dir(root: Path, holder: object) -> None:
    """Take `root`'s writer lock for `holder` (an engine's store, the CLI run) until `release_save_dirs`, or
    raise CheckpointError naming the live run that holds it: two runs saving into one folder replace each
    other's checkpoints and staging folders. The lock is a flock on the folder itself (nothing is written);
    the kernel drops it when the process ends, however it ends. Holders in one process share it. A file
    system that cannot lock a folder checks nothing; one that locks it node-locally (NFS) checks this node."""
    import fcntl

    key = root.resolve()
    if key in _held_locks:
        _held_locks[key][1].add(holder)
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot open the save folder '{root}': {exc.strerror or exc}", str(root)) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder_pid = _lock_holder(os.fstat(fd))
        os.close(fd)
        raise CheckpointError(
            f"'{root}' is the save folder of another live run (pid {holder_pid}): two runs saving there replace "
            "each other's checkpoints; give each run its own save_dir (--save-dir)"
        ) from None
    except OSError:  # this file system cannot lock a folder
        os.close(fd)
        return
    _held_locks[key] = (fd, {holder})


def _lock_holder(st: os.stat_result) -> str:
    """The pid holding a flock on the file of `st`, from /proc/locks ("?" where it cannot be told)."""
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if "FLOCK" in fields and "->" not in fields and fields[-3] == where:
                return fields[-4]
    except (OSError, IndexError):
        pass
    return "?"


def release_save_dirs(holder: object | None = None) -> None:
    """`holder` lets go of the folders it holds (all holders: None); a folder no one holds is unlocked."""
    for key, (fd, holders) in list(_held_locks.items()):
        holders.discard(holder) if holder is not None else holders.clear()
        if not holders:
            os.close(fd)
            del _held_locks[key]
