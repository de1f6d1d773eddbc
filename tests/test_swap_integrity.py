"""Every byte read back from the swap file is verified: damage done to the real file behind the store's
back (overwritten, bit-flipped, truncated, deleted, replaced) is an error at the next read, never data."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from infinity.config import AioConfig
from infinity.storage import ChecksumError, SwapFileChangedError, TierBudgets, TierStore, swap_identity
from infinity.storage.checksum import CRC32C_ENV_VAR

pytest_plugins = ["storage_fixtures"]  # real directories: a direct-I/O disk, mounts that refuse it
MiB = 1 << 20
NUMEL = 300_000  # 1_200_000 bytes of fp32: a slot of 1_200_128 bytes


def _store(path: Path, **kwargs) -> TierStore:
    return TierStore(str(path), AioConfig(), TierBudgets(), wait_timeout_s=10, nvme_grow_bytes=8 * MiB, **kwargs)


def _two_keys(store: TierStore) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = torch.randn(NUMEL), torch.randn(NUMEL)
    store.put("a", a, "nvme").wait()
    store.put("b", b, "nvme").wait()
    return a, b


def _poke(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def _flip_bit(path: str, offset: int, bit: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ (1 << bit)]))


def _assert_names_the_read(exc: ChecksumError, store: TierStore, key: str) -> None:
    path, offset, _ = store.location(key)
    message = str(exc)
    assert f"fetch of {key!r}" in message and path in message and exc.filename == path
    assert f"at offset {offset}, length {NUMEL * 4}" in message
    got, expected = message.split("(crc32c ")[1].split(")")[0].split(", expected ")
    assert got != expected and len(got) == len(expected) == 10  # two different 0x........ values
    assert "resume from its last checkpoint" in message


def test_random_bytes_written_into_a_shard_are_caught_and_the_other_key_still_reads(disk_dir: Path) -> None:
    with _store(disk_dir) as store:
        a, b = _two_keys(store)
        path, offset, _ = store.location("b")
        _poke(path, offset + 4096, os.urandom(64 * 1024))
        with pytest.raises(ChecksumError) as info:
            store.fetch("b", "host").wait()
        _assert_names_the_read(info.value, store, "b")
        assert "changed in place" in str(info.value)  # the file itself (inode, size, header) is intact
        assert store.tiers_holding("b") == ["nvme"]  # nothing of the damaged read is kept
        assert torch.equal(store.fetch("a", "host").wait(), a)  # damage to one slot is that slot's error
        store.release("a", "host")
        store.write("b", b).wait()  # new contents make the key whole again
        assert torch.equal(store.fetch("b", "host").wait(), b)


@pytest.mark.parametrize("where", ["first byte", "last byte", "random"])
def test_a_single_bit_flip_in_a_shard_is_caught(disk_dir: Path, where: str) -> None:
    with _store(disk_dir) as store:
        _two_keys(store)
        path, offset, _ = store.location("a")
        at = {"first byte": 0, "last byte": NUMEL * 4 - 1, "random": random.randrange(NUMEL * 4)}[where]
        _flip_bit(path, offset + at, random.randrange(8))
        with pytest.raises(ChecksumError) as info:
            store.fetch("a", "host").wait()
        _assert_names_the_read(info.value, store, "a")


def test_a_damaged_shard_never_reaches_the_device_tier(disk_dir: Path) -> None:
    with _store(disk_dir) as store:
        _two_keys(store)
        path, offset, _ = store.location("a")
        _flip_bit(path, offset + 12345, 3)
        with pytest.raises(ChecksumError):
            store.fetch("a", "device").wait()  # NVMe -> host (verified here) -> device
        assert store.tiers_holding("a") == ["nvme"]


def test_padding_past_the_shard_is_not_data_and_not_checked(disk_dir: Path) -> None:
    with _store(disk_dir) as store:
        a, _ = _two_keys(store)
        path, offset, padded = store.location("a")
        _poke(path, offset + NUMEL * 4, b"\xff" * (padded - NUMEL * 4))
        assert torch.equal(store.fetch("a", "host").wait(), a)


def test_a_truncation_hidden_by_a_later_extension_reads_zeros_that_the_checksum_catches(disk_dir: Path) -> None:
    """Why truncation went unnoticed before: once anything extends the file again, the cut range reads back
    as zeros without a short read. The size is whole again, so only the checksums can tell."""
    with _store(disk_dir) as store:
        _two_keys(store)
        path, offset, _ = store.location("a")
        size = os.path.getsize(path)
        os.truncate(path, offset)
        os.truncate(path, size)  # a hole: the same size, zeros where "a" was
        with open(path, "rb") as fh:
            fh.seek(offset)
            assert fh.read(4096) == bytes(4096)
        with pytest.raises(ChecksumError) as info:
            store.fetch("a", "host").wait()
        _assert_names_the_read(info.value, store, "a")


def test_a_truncated_file_is_caught_before_the_next_read_or_write(disk_dir: Path) -> None:
    with _store(disk_dir) as store:
        a, _ = _two_keys(store)
        os.truncate(store.swap_path, 4096)
        with pytest.raises(SwapFileChangedError) as info:
            store.fetch("a", "host").wait()
        message = str(info.value)
        assert "fetch of 'a'" in message and store.swap_path in message and "is 4096 bytes" in message
        assert "truncated" in message and "resume from its last checkpoint" in message
        with pytest.raises(SwapFileChangedError, match="truncated"):
            store.write("a", a).wait()
        with pytest.raises(SwapFileChangedError, match="truncated"):
            store.put("c", torch.ones(10), "nvme").wait()


def test_a_deleted_file_is_caught_at_the_next_access(disk_dir: Path) -> None:
    with _store(disk_dir) as store:
        _two_keys(store)
        os.unlink(store.swap_path)
        with pytest.raises(SwapFileChangedError) as info:
            store.fetch("a", "host").wait()
        assert store.swap_path in str(info.value) and "was deleted while the run was using it" in str(info.value)
    assert list(disk_dir.iterdir()) == []


def test_a_replaced_file_is_caught_and_the_replacement_is_left_alone(disk_dir: Path) -> None:
    store = _store(disk_dir)
    a, _ = _two_keys(store)
    copy = disk_dir / "copy"
    shutil.copyfile(store.swap_path, copy)  # the same bytes, even: still not the file the run wrote
    os.replace(copy, store.swap_path)
    with pytest.raises(SwapFileChangedError) as info:
        store.fetch("a", "host").wait()
    assert store.swap_path in str(info.value) and "was replaced" in str(info.value)
    store.close()
    assert Path(store.swap_path).exists()  # someone else's file now: close removes only its own


def test_an_overwritten_header_is_caught(disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(swap_identity, "HEADER_CHECK_INTERVAL_S", 0.0)  # look at the header on every access
    with _store(disk_dir) as store:
        a, _ = _two_keys(store)
        _poke(store.swap_path, 0, os.urandom(512))
        with pytest.raises(SwapFileChangedError) as info:
            for _ in range(100):  # the header is read asynchronously: an access finds the last look's result
                store.fetch("a", "host").wait()
                store.release("a", "host")
                store.evict("a")
        assert store.swap_path in str(info.value) and "header" in str(info.value) and "overwritten" in str(info.value)


def test_a_checksum_error_names_an_overwritten_header_as_the_cause(disk_dir: Path) -> None:
    with _store(disk_dir) as store:
        _two_keys(store)
        _poke(store.swap_path, 0, os.urandom(2 * MiB))  # the header and the start of "a"
        with pytest.raises(ChecksumError) as info:
            store.fetch("a", "host").wait()
        assert "header" in str(info.value) and "overwritten" in str(info.value)


def test_the_table_path_verifies_the_same_way(disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CRC32C_ENV_VAR, "table")
    with _store(disk_dir) as store:
        assert store._file.engine.crc_path == "table"
        a, _ = _two_keys(store)
        assert torch.equal(store.fetch("a", "host").wait(), a)
        store.release("a", "host")
        store.evict("a")
        path, offset, _ = store.location("a")
        _flip_bit(path, offset + 777, 0)
        with pytest.raises(ChecksumError):
            store.fetch("a", "host").wait()


def test_damage_is_caught_on_the_aiofiles_backend_too(no_direct_io_dir: Path) -> None:
    with _store(no_direct_io_dir) as store:
        assert store.backend == "aiofiles"
        a, _ = _two_keys(store)
        assert torch.equal(store.fetch("a", "host").wait(), a)
        store.release("a", "host")
        store.evict("a")
        path, offset, _ = store.location("a")
        _flip_bit(path, offset + 4097, 6)
        with pytest.raises(ChecksumError) as info:
            store.fetch("a", "host").wait()
        _assert_names_the_read(info.value, store, "a")
