"""Real directories for the storage tests: one on a disk that takes O_DIRECT, and mounts that refuse it.

Nothing here mocks a disk. Mount-based fixtures need root (CAP_SYS_ADMIN) and skip without it.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from infinity.storage import supports_direct_io

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def disk_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a real disk with direct I/O (tmp_path, or a scratch dir in the repo if /tmp is tmpfs)."""
    if supports_direct_io(str(tmp_path)):
        yield tmp_path
        return
    scratch = Path(tempfile.mkdtemp(prefix=".storage-test-", dir=REPO))
    try:
        if not supports_direct_io(str(scratch)):
            pytest.skip("no directory on a filesystem that takes O_DIRECT")
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def mounted(target: Path, *args: str) -> Iterator[Path]:
    """`mount <args> <target>` for the block, unmounted after; skips the test where mounting is refused."""
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount ({' '.join(args)}): {done.stderr.strip()} (needs root)")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture
def no_direct_io_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory whose filesystem refuses O_DIRECT: /dev/shm where tmpfs still does, else a ramfs mount."""
    shm = Path("/dev/shm")
    if shm.is_dir() and not supports_direct_io(str(shm)):
        scratch = Path(tempfile.mkdtemp(prefix="infinity-test-", dir=shm))
        yield scratch
        shutil.rmtree(scratch, ignore_errors=True)
        return
    # Since Linux 6.6 tmpfs accepts O_DIRECT; ramfs still refuses it.
    with mounted(tmp_path / "ramfs", "-t", "ramfs", "none") as path:
        yield path


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A read-only directory that root cannot write either: a read-only bind mount."""
    source = tmp_path / "ro-source"
    source.mkdir()
    target = tmp_path / "ro"
    with mounted(target, "--bind", str(source)):
        done = subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot remount read-only: {done.stderr.strip()}")
        yield target


@pytest.fixture
def tiny_fs_dir(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB filesystem (tmpfs with a size limit): a full disk for ENOSPC."""
    with mounted(tmp_path / "tiny", "-t", "tmpfs", "-o", "size=1m", "none") as path:
        yield path
