"""Failures of the swap path, each a clear exception, with the store still serving its other keys."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from infinity.config import AioConfig
from infinity.storage import (
    StorageError,
    SwapFileChangedError,
    SwapFileError,
    TierBudgets,
    TierStore,
    check_free_space,
    swap_file_bytes,
)

pytest_plugins = ["storage_fixtures"]  # real directories: a direct-I/O disk, mounts that refuse it
MiB = 1 << 20


def _store(path: Path, **kwargs) -> TierStore:
    return TierStore(str(path), AioConfig(), TierBudgets(), wait_timeout_s=10, **kwargs)


def test_a_missing_nvme_path_is_reported_at_start(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(StorageError) as info:
        _store(missing)
    assert info.value.errno == errno.ENOENT and str(missing) in str(info.value)


def test_a_read_only_nvme_path_is_reported_with_its_free_space(read_only_dir: Path) -> None:
    with pytest.raises(StorageError) as info:
        _store(read_only_dir)
    assert info.value.errno == errno.EROFS
    assert str(read_only_dir) in str(info.value) and "bytes free" in str(info.value)


def test_a_full_nvme_path_is_reported_at_start_with_its_free_space(tiny_fs_dir: Path) -> None:
    with pytest.raises(StorageError) as info:
        _store(tiny_fs_dir, nvme_grow_bytes=64 * MiB)
    assert info.value.errno == errno.ENOSPC
    assert str(tiny_fs_dir) in str(info.value) and "bytes free" in str(info.value)
    assert list(tiny_fs_dir.iterdir()) == []  # nothing left behind


def test_a_disk_filling_up_fails_the_put_that_grows_the_file_and_nothing_else(tiny_fs_dir: Path) -> None:
    with _store(tiny_fs_dir, nvme_grow_bytes=128 * 1024) as store:
        kept, error = {}, None
        for i in range(20):  # 20 x 100 KiB shards cannot fit in 1 MiB
            t = torch.randn(25_000)
            try:
                store.put(i, t, "nvme").wait()
            except StorageError as exc:
                error = exc
                break
            kept[i] = t
        assert error is not None and error.errno == errno.ENOSPC
        assert "cannot grow the swap file" in str(error) and "bytes free" in str(error)
        assert i not in store and len(kept) >= 3
        for key, t in kept.items():
            assert torch.equal(store.fetch(key, "host").wait(), t)
            store.release(key, "host")


def test_a_foreign_file_in_the_way_is_refused_and_left_alone(disk_dir: Path) -> None:
    foreign = disk_dir / "infinity-rank0.swap"
    foreign.write_bytes(b"precious user data" * 1000)
    with pytest.raises(SwapFileError, match="not an infinity swap file"):
        _store(disk_dir)
    assert foreign.read_bytes().startswith(b"precious user data")


_LIVE_CHILD = """
import sys, time
from infinity.config import AioConfig
from infinity.storage import TierBudgets, TierStore
store = TierStore(sys.argv[1], AioConfig(), TierBudgets(), nvme_grow_bytes=1 << 20)
print(store.swap_path, flush=True)
time.sleep(60)
"""


def test_a_live_runs_file_is_refused_and_a_killed_runs_file_is_replaced(disk_dir: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", _LIVE_CHILD, str(disk_dir)], stdout=subprocess.PIPE, text=True)
    try:
        swap = Path(child.stdout.readline().strip())
        assert swap.exists()
        with pytest.raises(SwapFileError, match="live run") as info:
            _store(disk_dir)
        assert info.value.errno == errno.EBUSY
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert swap.exists()  # a killed run cannot clean up
    with pytest.warns(UserWarning, match="stale swap file"):
        store = _store(disk_dir)
    store.put("a", torch.ones(10), "nvme").wait()
    store.close()
    assert not swap.exists()


def test_two_stores_of_one_process_cannot_share_a_file(disk_dir: Path) -> None:
    with _store(disk_dir):
        with pytest.raises(SwapFileError, match="live run"):
            _store(disk_dir)
        with _store(disk_dir, rank=1) as other:
            assert other.swap_path.endswith("infinity-rank1.swap")


def test_a_file_truncated_behind_the_stores_back_stops_every_later_access(disk_dir: Path) -> None:
    with _store(disk_dir) as store:
        low, high = torch.randn(300_000), torch.randn(300_000)
        store.put("low", low, "nvme").wait()
        store.put("high", high, "nvme").wait()
        high_offset = store._shards["high"].nvme_offset
        os.truncate(store.swap_path, high_offset + 4096)
        with pytest.raises(SwapFileChangedError) as info:
            store.fetch("high", "host").wait()
        message = str(info.value)
        assert "fetch of 'high'" in message and store.swap_path in message
        assert f"is {high_offset + 4096} bytes" in message and "truncated" in message and "resume" in message
        assert "host" not in store.tiers_holding("high")
        # The file is no longer trusted: intact keys, new keys and new contents all refuse, naming the cause.
        with pytest.raises(SwapFileChangedError, match="truncated"):
            store.fetch("low", "device").wait()
        with pytest.raises(SwapFileChangedError, match="truncated"):
            store.write("low", low).wait()
        with pytest.raises(SwapFileError, match="truncated"):
            store.fetch("low", "host").wait()  # its last write failed: the same cause, named again


def test_close_removes_the_swap_file_and_refuses_further_use(disk_dir: Path) -> None:
    store = _store(disk_dir)
    store.put("a", torch.ones(5), "nvme").wait()
    path = Path(store.swap_path)
    assert path.exists()
    store.close()
    store.close()
    assert not path.exists() and list(disk_dir.iterdir()) == []
    with pytest.raises(RuntimeError, match="closed"):
        store.fetch("a", "host")


_EXIT_CHILD = """
import sys
import torch
from infinity.config import AioConfig
from infinity.storage import TierBudgets, TierStore
store = TierStore(sys.argv[1], AioConfig(), TierBudgets(), nvme_grow_bytes=1 << 20)
store.put("a", torch.ones(1000), "nvme").wait()
print(store.swap_path, flush=True)
"""


def test_the_swap_file_is_removed_at_interpreter_exit(disk_dir: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _EXIT_CHILD, str(disk_dir)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not Path(done.stdout.strip()).exists() and list(disk_dir.iterdir()) == []


_FSIZE_CHILD = """
import resource, signal, sys
import torch
from infinity.config import AioConfig
from infinity.storage import (
    StorageError,
    SwapFileChangedError,
    SwapFileError,
    TierBudgets,
    TierStore,
    check_free_space,
    swap_file_bytes,
)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
store = TierStore(sys.argv[1], AioConfig(), TierBudgets(), nvme_grow_bytes=8 << 20)
kept = torch.randn(1 << 18)
store.put("kept", kept, "nvme").wait()
# Limit below the preallocated 8 MiB: the next write past it fails, and so does growing the file.
resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
try:
    store.put("past-limit", torch.randn(1 << 20), "nvme").wait()
except StorageError as exc:
    print("WRITE", exc.errno, exc)
try:
    store.fetch("past-limit", "host").wait()
except SwapFileError as exc:
    print("LOST", exc)
try:
    store.put("growing", torch.randn(3 << 20), "nvme")
except StorageError as exc:
    print("GROW", exc.errno, exc)
assert torch.equal(store.fetch("kept", "host").wait(), kept)
print("STILL USABLE")
store.close()
"""


def test_writes_past_a_file_size_limit_fail_with_efbig_and_the_rest_survives(disk_dir: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, str(disk_dir)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # SIGXFSZ would have killed it
    out = done.stdout
    assert f"WRITE {errno.EFBIG}" in out and "infinity-rank0.swap" in out and "offset" in out
    assert "LOST" in out and "last write failed" in out
    assert f"GROW {errno.EFBIG}" in out and "cannot grow the swap file" in out
    assert "STILL USABLE" in out


def test_a_budget_wait_that_nothing_ends_times_out(disk_dir: Path) -> None:
    store = TierStore(str(disk_dir), AioConfig(), TierBudgets(device_bytes=MiB), wait_timeout_s=0.3)
    with store:
        for key in "ab":
            store.put(key, torch.randn(MiB // 4), "host").wait()
        store.fetch("a", "device").wait()
        start = time.monotonic()
        with pytest.raises(MemoryError, match="waited 0.3 s"):
            store.fetch("b", "device")
        assert time.monotonic() - start < 5
        store.release("a", "device")
        store.fetch("b", "device").wait()


def _small_fs(tmp_path: Path, size: str):
    from storage_fixtures import mounted

    return mounted(tmp_path / "small", "-t", "tmpfs", "-o", f"size={size}", "none")


def test_a_store_sized_to_its_need_fits_a_small_disk_that_the_default_growth_does_not(tmp_path: Path) -> None:
    shards = {i: torch.randn(250_000) for i in range(4)}  # 4 x 1 MB (slots of 1_003_520 bytes)
    need = sum((t.numel() * 4 + 4095) // 4096 * 4096 for t in shards.values())
    with _small_fs(tmp_path, "20m") as small:
        with pytest.raises(StorageError) as info:
            _store(small)  # the default first growth is 256 MiB
        assert info.value.errno == errno.ENOSPC and "bytes free" in str(info.value)
        with _store(small, expected_nvme_bytes=need) as store:
            assert os.path.getsize(store.swap_path) == 4096 + need == swap_file_bytes(need)  # header, then the need
            for key, t in shards.items():
                store.put(key, t, "nvme").wait()
            assert os.path.getsize(store.swap_path) == 4096 + need  # no growth was needed
            for key, t in shards.items():
                assert torch.equal(store.fetch(key, "host").wait(), t)
                store.release(key, "host")
        assert list(small.iterdir()) == []


def test_growth_past_the_expected_need_is_in_small_steps(disk_dir: Path) -> None:
    with _store(disk_dir, expected_nvme_bytes=16 * MiB) as store:
        assert os.path.getsize(store.swap_path) == 4096 + 16 * MiB
        store.put("a", torch.randn(4 * MiB), "nvme").wait()  # 16 MiB: fills the first growth
        store.put("b", torch.ones(10), "nvme").wait()
        assert os.path.getsize(store.swap_path) == 4096 + 16 * MiB + 2 * MiB  # an eighth of the need
    with _store(disk_dir, expected_nvme_bytes=64 * MiB, nvme_grow_bytes=4 * MiB) as store:
        store.put("a", torch.randn(16 * MiB), "nvme").wait()
        store.put("b", torch.ones(10), "nvme").wait()
        assert os.path.getsize(store.swap_path) == 4096 + 64 * MiB + 4 * MiB  # never more than nvme_grow_bytes


def test_the_first_growth_stays_within_the_nvme_budget(disk_dir: Path) -> None:
    store = TierStore(str(disk_dir), AioConfig(), TierBudgets(nvme_bytes=3 * MiB), expected_nvme_bytes=64 * MiB)
    with store:
        assert os.path.getsize(store.swap_path) == 4096 + 3 * MiB
    with TierStore(str(disk_dir), AioConfig(), TierBudgets(nvme_bytes=3 * MiB)) as store:
        assert os.path.getsize(store.swap_path) == 4096 + 3 * MiB


def test_the_free_space_check_says_what_is_needed_and_what_is_free(tiny_fs_dir: Path) -> None:
    check_free_space(str(tiny_fs_dir), 100 * 1024)  # fits in 1 MiB
    with pytest.raises(StorageError) as info:
        check_free_space(str(tiny_fs_dir), 3 * MiB)
    free = shutil.disk_usage(tiny_fs_dir).free
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tiny_fs_dir)
    assert f"has {free} bytes free" in message and f"need {3 * MiB} bytes" in message
    assert f"free {3 * MiB - free} bytes there" in message
    assert f"({free / MiB:.1f} MiB)" in message and "(3.0 MiB)" in message  # 0.00 GiB against 0.00 GiB said nothing
    from infinity.cli.faults import classify

    line = classify(info.value).message  # as the command prints it: its own advice, not the generic one as well
    assert line.count("free space there or choose another disk") + line.count("larger disk") == 1
    with pytest.raises(StorageError) as info:
        check_free_space(str(tiny_fs_dir / "missing"), 1)
    assert info.value.errno == errno.ENOENT and "not an existing directory" in str(info.value)
