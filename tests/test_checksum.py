"""CRC32C: every native path against published test vectors and an independent pure-Python reference,
and the checksum the I/O engines compute per request on their worker threads, on real files."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from infinity.config import AioConfig
from infinity.config.schema import parse_section
from infinity.storage import ALIGN, DirectEngine, aligned_empty, crc32c, open_engine, resolve_crc32c_path
from infinity.storage.checksum import CRC32C_ENV_VAR, crc32c_address, crc32c_combine, supported_crc32c_paths

pytest_plugins = ["storage_fixtures"]  # real directories: a direct-I/O disk, mounts that refuse it
PATHS = supported_crc32c_paths()
MiB = 1 << 20


def _reference_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):  # bit by bit, reflected Castagnoli polynomial
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


_TABLE = _reference_table()


def reference_crc32c(data: bytes) -> int:
    """CRC32C as RFC 3720 (iSCSI) defines it, one byte at a time."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# RFC 3720 appendix B.4 and the customary check value.
VECTORS = [
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (b"", 0),
]


def test_the_reference_itself_gives_the_published_values() -> None:
    for data, want in VECTORS:
        assert reference_crc32c(data) == want


@pytest.mark.parametrize("path", PATHS)
def test_published_test_vectors(path: str) -> None:
    for data, want in VECTORS:
        assert crc32c(data, path=path) == want, data


@pytest.mark.parametrize("path", PATHS)
def test_every_length_and_misalignment_matches_the_reference(path: str) -> None:
    rng = random.Random(1)
    # Around the kernels' boundaries: 8-byte words, 3 x 256 and 3 x 8192 interleaved rounds; the fold's
    # shortest input (320), its 256-byte rounds and its 64- and 16-byte steps.
    lengths = [0, 1, 7, 8, 9, 767, 768, 769, 24575, 24576, 24577, 3 * 24576 + 3 * 768 + 13, 100_003]
    lengths += [319, 320, 321, 383, 384, 575, 576, 4096 + 64 + 16 + 5]
    lengths += [rng.randrange(1, 70_000) for _ in range(10)]
    for n in lengths:
        data = bytes(rng.getrandbits(8) for _ in range(n + 8))
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for skip in (0, 1, 5):
            assert crc32c(buf[skip : skip + n], path=path) == reference_crc32c(data[skip : skip + n]), (n, skip)


@pytest.mark.parametrize("path", PATHS)
def test_continuing_and_combining_give_the_checksum_of_the_whole(path: str) -> None:
    rng = random.Random(2)
    data = bytes(rng.getrandbits(8) for _ in range(50_000))
    whole = reference_crc32c(data)
    for cut in (0, 1, 4096, 24577, 49_999, 50_000):
        a, b = data[:cut], data[cut:]
        assert crc32c(b, crc32c(a, path=path), path=path) == whole
        assert crc32c_combine(reference_crc32c(a), reference_crc32c(b), len(b)) == whole


@pytest.mark.skipif("avx512" not in PATHS, reason="this CPU lacks AVX-512 with VPCLMULQDQ")
def test_every_branch_of_the_folding_kernel_matches_the_table() -> None:
    """Every length to 2 KiB, each multiple of 256 to 8 KiB give or take up to 63 (the fold's 256-byte rounds
    followed by each count of 64- and 16-byte steps and tail bytes), and a few MiB, at every offset in a
    cache line (the fold's unaligned head), from a zero and a non-zero register."""
    rng = random.Random(5)
    lengths = list(range(2049))
    lengths += [m + d for m in range(256, 8193, 256) for d in range(-63, 64) if m + d > 2048]
    lengths += [3 * MiB, 3 * MiB + 77, 5 * MiB - 1]
    buf = _random_buffer(max(lengths) + 64, 6)
    base = buf.data_ptr()
    assert base % 64 == 0
    mismatches = []
    for n in lengths:
        for offset in range(64):
            for crc in (0, rng.getrandbits(32)):
                want = crc32c_address(base + offset, n, crc, "table")
                got = crc32c_address(base + offset, n, crc, "avx512")
                if got != want:
                    mismatches.append((n, offset, crc, got, want))
    assert not mismatches, mismatches[:10]
    # The table itself, against the reference, on a few of these.
    data = buf[: 8192 + 64].numpy().tobytes()
    for n, offset in ((320, 1), (2047, 63), (8192 - 1, 17)):
        assert crc32c_address(base + offset, n, 0, "table") == reference_crc32c(data[offset : offset + n])


def test_a_single_bit_flip_anywhere_changes_the_checksum() -> None:
    data = bytearray(random.Random(3).getrandbits(8) for _ in range(ALIGN))
    before = crc32c(data)
    for bit in random.Random(4).sample(range(8 * len(data)), 200):
        data[bit // 8] ^= 1 << (bit % 8)
        assert crc32c(data) != before
        data[bit // 8] ^= 1 << (bit % 8)


def _cpu_flags() -> set[str]:
    """What the kernel says this CPU has (empty where /proc/cpuinfo says nothing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


def test_the_path_is_chosen_at_run_time_and_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    assert PATHS[-1] == "table"
    flags = _cpu_flags()
    if {"sse4_2", "pclmulqdq", "avx512f", "avx512vl", "vpclmulqdq"} <= flags:
        assert PATHS[0] == "avx512"
    elif "sse4_2" in flags:
        assert PATHS[0] == "sse4.2"
    assert resolve_crc32c_path() == PATHS[0]
    monkeypatch.setenv(CRC32C_ENV_VAR, "table")
    assert resolve_crc32c_path() == "table"
    if "sse4.2" in PATHS:  # the older instruction can still be chosen where a faster path exists
        monkeypatch.setenv(CRC32C_ENV_VAR, "sse4.2")
        assert resolve_crc32c_path() == "sse4.2"
    assert resolve_crc32c_path("sse4.2" if "sse4.2" in PATHS else "table") in PATHS
    with pytest.raises(ValueError, match="not a CRC32C path"):
        resolve_crc32c_path("md5")


def _random_buffer(nbytes: int, seed: int) -> torch.Tensor:
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return buf


def _engine_checksums(engine, directory: Path) -> None:
    """Writes and reads of several chunks each: the handle's crc32c is that of the prefix asked for."""
    f = engine.open(str(directory / "data"), create=True)
    try:
        cases = [(5 * ALIGN, 5 * ALIGN), (300 * ALIGN, 300 * ALIGN - 123), (70 * ALIGN, 17), (64 * ALIGN, ALIGN)]
        offset = 0
        for i, (nbytes, prefix) in enumerate(cases):
            src = _random_buffer(nbytes, i)
            want = reference_crc32c(src[:prefix].numpy().tobytes())
            wrote = engine.write(f, src, offset, prefix)
            wrote.wait()
            assert wrote.crc32c == want
            dst = aligned_empty(nbytes)
            read = engine.read(f, dst, offset, prefix)
            read.wait()
            assert read.crc32c == want and torch.equal(dst, src)
            unchecked = engine.read(f, dst, offset)
            unchecked.wait()
            assert unchecked.crc32c is None
            offset += nbytes
    finally:
        engine.close_file(f)
        engine.close()


SMALL_BLOCKS = parse_section(AioConfig, {"block_size": 16 * ALIGN, "queue_depth": 4, "intra_op_parallelism": 2})


@pytest.mark.parametrize("use_kaio", [True, False], ids=["kaio", "pread"])
@pytest.mark.parametrize("path", PATHS)
def test_the_direct_engine_checksums_each_request_across_its_chunks(disk_dir: Path, use_kaio: bool, path: str) -> None:
    _engine_checksums(DirectEngine(SMALL_BLOCKS, use_kaio=use_kaio, crc_path=path), disk_dir)


def test_the_aiofiles_engine_checksums_each_request(no_direct_io_dir: Path) -> None:
    engine = open_engine(SMALL_BLOCKS, str(no_direct_io_dir))
    assert engine.backend == "aiofiles"
    _engine_checksums(engine, no_direct_io_dir)


def test_a_checksum_longer_than_the_request_is_refused(disk_dir: Path) -> None:
    engine = open_engine(AioConfig(), str(disk_dir))
    f = engine.open(str(disk_dir / "data"), create=True)
    with pytest.raises(ValueError, match="crc_bytes"):
        engine.write(f, aligned_empty(ALIGN), 0, ALIGN + 1)
    engine.close_file(f)
    engine.close()
