"""The async I/O engines against real files: O_DIRECT on the disk, aiofiles where direct I/O is refused."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from infinity.config import AioConfig
from infinity.storage import ALIGN, DirectEngine, StorageError, aligned_empty, open_engine

pytest_plugins = ["storage_fixtures"]  # real directories: a direct-I/O disk, mounts that refuse it
MiB = 1 << 20


def _random_bytes(nbytes: int) -> torch.Tensor:
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    return buf


def _round_trip(engine, path: Path, sizes: list[int]) -> None:
    f = engine.open(str(path), create=True)
    try:
        offsets, offset = [], 0
        for size in sizes:
            offset += random.randrange(0, 4) * ALIGN  # gaps: requests land at scattered aligned offsets
            offsets.append(offset)
            offset += size
        sources = [_random_bytes(size) for size in sizes]
        writes = [engine.write(f, src, off) for src, off in zip(sources, offsets, strict=True)]  # all in flight at once
        for handle in writes:
            handle.wait()
        targets = [aligned_empty(size) for size in sizes]
        reads = [engine.read(f, dst, off) for dst, off in zip(targets, offsets, strict=True)]
        for handle in reads:
            handle.wait()
        for src, dst in zip(sources, targets, strict=True):
            assert torch.equal(src, dst)
    finally:
        engine.close_file(f)


SIZES = [ALIGN, 3 * ALIGN, MiB, MiB + 5 * ALIGN, 3 * MiB - ALIGN, 8 * MiB]


@pytest.mark.parametrize("use_kaio", [True, False], ids=["kaio", "pread"])
def test_direct_round_trip_of_scattered_requests(disk_dir: Path, use_kaio: bool) -> None:
    engine = DirectEngine(AioConfig(), use_kaio=use_kaio)
    assert engine.submitter == ("kaio" if use_kaio else "pread")
    sizes = SIZES + [random.randrange(1, 512) * ALIGN for _ in range(40)]
    random.shuffle(sizes)
    _round_trip(engine, disk_dir / "data", sizes)
    engine.close()


@pytest.mark.parametrize(
    "knobs",
    [
        {"block_size": ALIGN, "queue_depth": 1},
        {"block_size": 64 * ALIGN, "queue_depth": 32, "intra_op_parallelism": 4},
        {"single_submit": True, "overlap_events": False},
        {"thread_count": 2, "queue_depth": 2},
    ],
    ids=["tiny-blocks", "deep-queues", "single-submit-no-overlap", "thread-count-alias"],
)
def test_every_knob_setting_round_trips(disk_dir: Path, knobs: dict) -> None:
    from infinity.config.schema import parse_section

    cfg = parse_section(AioConfig, knobs)
    engine = open_engine(cfg, str(disk_dir))
    assert engine.backend == "odirect"
    _round_trip(engine, disk_dir / "data", [MiB + 3 * ALIGN, 5 * ALIGN, 2 * MiB])
    engine.close()


def test_the_largest_settings_the_config_takes_start_and_round_trip_without_kernel_aio(disk_dir: Path) -> None:
    """queue_depth x intra_op_parallelism blocking workers stand in for kernel AIO where io_setup refuses
    (fs.aio-max-nr): 8192 x 1024 of them aborted the process (std::terminate, no message); they are capped."""
    from infinity.config import ConfigError
    from infinity.config.schema import parse_section

    cfg = parse_section(AioConfig, {"queue_depth": 8192, "intra_op_parallelism": 1024})
    engine = DirectEngine(cfg, use_kaio=False)
    _round_trip(engine, disk_dir / "data", [MiB + 3 * ALIGN, 5 * ALIGN])
    engine.close()
    for key, value in (("queue_depth", 65536), ("intra_op_parallelism", 100000), ("thread_count", 100000)):
        with pytest.raises(ConfigError, match=f"'{key}'.*" if key != "thread_count" else "thread_count|intra_op"):
            parse_section(AioConfig, {key: value})


def test_submit_returns_at_once_and_wait_releases_the_gil(disk_dir: Path) -> None:
    """Counted, not timed: `write` returns with its 256 MiB still in flight, and while this thread waits
    another one runs Python until the write is done (a wait holding the GIL would leave it no turn)."""
    engine = open_engine(AioConfig(), str(disk_dir))
    f = engine.open(str(disk_dir / "data"), create=True)
    os.posix_fallocate(f.fd, 0, 256 * MiB)
    buf = aligned_empty(256 * MiB)
    handle = engine.write(f, buf, 0)
    assert not handle.done()  # submitted, not performed
    waiting = threading.Event()
    turns = []

    def count_while_in_flight() -> None:
        waiting.wait()
        n = 0
        while not handle.done():
            n += 1
        turns.append(n)

    counter = threading.Thread(target=count_while_in_flight)
    counter.start()
    waiting.set()
    handle.wait()
    counter.join()
    assert handle.done()
    assert turns[0] > 1000  # Python ran while this thread waited for the disk
    engine.close_file(f)
    engine.close()


def test_short_read_past_end_of_file_is_an_error_naming_file_offset_and_length(disk_dir: Path) -> None:
    engine = open_engine(AioConfig(), str(disk_dir))
    path = disk_dir / "short"
    f = engine.open(str(path), create=True)
    engine.write(f, _random_bytes(2 * ALIGN), 0).wait()
    with pytest.raises(StorageError) as info:
        engine.read(f, aligned_empty(4 * ALIGN), 0).wait()
    err = info.value
    assert err.errno == errno.EIO and err.filename == str(path)
    assert "short read" in str(err) and "got 8192 of 16384 bytes" in str(err) and "offset 0" in str(err)
    engine.read(f, aligned_empty(2 * ALIGN), 0).wait()  # the engine goes on serving
    engine.close_file(f)
    engine.close()


def test_misaligned_requests_are_refused_before_submission(disk_dir: Path) -> None:
    engine = open_engine(AioConfig(), str(disk_dir))
    f = engine.open(str(disk_dir / "x"), create=True)
    buf = aligned_empty(2 * ALIGN)
    with pytest.raises(ValueError, match="4096-aligned"):
        engine.write(f, buf[1 : 1 + ALIGN], 0)
    with pytest.raises(ValueError, match="4096-aligned"):
        engine.write(f, buf[:ALIGN], 512)
    engine.close_file(f)
    engine.close()


def test_full_filesystem_gives_enospc_with_the_file_name(tiny_fs_dir: Path) -> None:
    engine = open_engine(AioConfig(), str(tiny_fs_dir))
    path = tiny_fs_dir / "big"
    f = engine.open(str(path), create=True)
    with pytest.raises(StorageError) as info:
        engine.write(f, _random_bytes(4 * MiB), 0).wait()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert "length" in str(info.value) and "offset" in str(info.value)
    engine.close_file(f)
    engine.close()


_FSIZE_CHILD = """
import errno, os, resource, signal, sys
from infinity.config import AioConfig
from infinity.storage import StorageError, aligned_empty, open_engine
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # as in a process that did not start from CPython's defaults
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
engine = open_engine(AioConfig(), sys.argv[1])
f = engine.open(os.path.join(sys.argv[1], "limited"), create=True)
try:
    engine.write(f, aligned_empty(2 << 20), 0).wait()
    print("NO ERROR")
except StorageError as exc:
    print("ERRNO", exc.errno, exc)
engine.write(f, aligned_empty(1 << 20), 0).wait()
print("STILL USABLE")
"""


def test_write_past_file_size_limit_gives_efbig_not_sigxfsz(disk_dir: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, str(disk_dir)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # SIGXFSZ would kill it (returncode -25)
    assert f"ERRNO {errno.EFBIG}" in done.stdout and "limited" in done.stdout
    assert "STILL USABLE" in done.stdout


def test_aiofiles_backend_serves_where_direct_io_is_refused(no_direct_io_dir: Path) -> None:
    engine = open_engine(AioConfig(), str(no_direct_io_dir))
    assert engine.backend == "aiofiles"
    _round_trip(engine, no_direct_io_dir / "data", [ALIGN, MiB + ALIGN, 3 * MiB, 17 * ALIGN] * 4)
    f = engine.open(str(no_direct_io_dir / "short"), create=True)
    engine.write(f, _random_bytes(ALIGN), 0).wait()
    handle = engine.read(f, aligned_empty(2 * ALIGN), 0)
    with pytest.raises(StorageError, match="short read"):
        handle.wait()
    assert handle.done()
    engine.close_file(f)
    engine.close()
