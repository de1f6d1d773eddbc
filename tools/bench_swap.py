"""Swap bandwidth through the TierStore against the disk's raw direct-I/O bandwidth measured by fio.

For each shard size, store runs and fio runs are interleaved and repeated (the disk is noisy) and
medians are reported. Store write: `write()` of new contents for every key from 4 KiB-aligned
host memory, written in place as host copies are (steady state: the slots exist, as after the
first optimizer step); write_staged: the same from an unaligned tensor, through a staging copy.
Store read: `fetch(key, "host")` in key order with a prefetch window, then `release`. fio: the
same region of the same swap file, sequential, the engine's block size, libaio at --fio-iodepth.
The store runs as training does: every write records a CRC32C, every read is checked against it,
and the file's identity is checked before each access. Also measured: the checksum's own speed
(one thread, each path this CPU runs, over one engine block of 1 MiB as the I/O threads see it and
over a buffer larger than the caches) and the identity check's cost per access. Every file is
removed at the end. The last line is one JSON object.

    python tools/bench_swap.py [--size-gib G] [--shard-mib 1 8 64] [--repeats 3] [--dir PATH] --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from infinity.config import AioConfig
from infinity.config.schema import parse_section
from infinity.storage import TierBudgets, TierStore, aligned_empty
from infinity.storage.checksum import crc32c, resolve_crc32c_path, supported_crc32c_paths

MiB = 1 << 20


def fio_available() -> str | None:
    """fio's version string, or None when it is not installed."""
    if shutil.which("fio") is None:
        return None
    return subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()


def fio_gbps(path: str, offset: int, rw: str, size: int, block: int, iodepth: int) -> float:
    cmd = [
        "fio",
        "--name=raw",
        f"--filename={path}",
        f"--offset={offset}",
        f"--size={size}",
        f"--bs={block}",
        "--direct=1",
        f"--rw={rw}",
        "--ioengine=libaio",
        f"--iodepth={iodepth}",
        "--output-format=json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(done.stdout)["jobs"][0]
    return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


def store_write_gbps(store: TierStore, keys: list[int], source: torch.Tensor) -> float:
    start = time.perf_counter()
    handles = [store.write(key, source) for key in keys]  # staging buffers bound how many are in flight
    for handle in handles:
        handle.wait()
    return len(keys) * source.numel() / (time.perf_counter() - start) / 1e9


def store_read_gbps(store: TierStore, keys: list[int], shard_bytes: int, window: int) -> float:
    for key in keys:
        store.evict(key)  # cold: every byte comes from the disk
    start = time.perf_counter()
    refill = max(1, window // 4)  # top the window up every few shards, as a scheduler prefetches buckets
    for i, key in enumerate(keys):
        if i % refill == 0:
            store.prefetch(keys[i + 1 : i + 1 + window], "host")
        store.fetch(key, "host").wait()
        store.release(key, "host")
    return len(keys) * shard_bytes / (time.perf_counter() - start) / 1e9


def checksum_gbps(path: str, nbytes: int, repeats: int) -> float:
    """CRC32C throughput of one thread over `nbytes` of memory (the median of at least `repeats` passes)."""
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    crc32c(buf, path=path)  # touch the pages and warm the tables
    times = []
    for _ in range(max(repeats, (256 * MiB) // nbytes)):  # small buffers: more passes, a steadier median
        start = time.perf_counter()
        crc32c(buf, path=path)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def identity_check_us(store: TierStore, checks: int = 20_000) -> float:
    """Microseconds per swap-file identity check (an fstat and a stat), which precedes every NVMe read and write."""
    nvme = store._file
    start = time.perf_counter()
    for _ in range(checks):
        nvme._identity.check(nvme.size_bytes)
    return (time.perf_counter() - start) / checks * 1e6


def bench_shard_size(
    workdir: Path,
    aio: AioConfig,
    shard_bytes: int,
    total_bytes: int,
    repeats: int,
    window: int,
    fio_depth: int,
    use_fio: bool,
) -> dict:
    keys = list(range(max(1, total_bytes // shard_bytes)))
    size = len(keys) * shard_bytes
    source = aligned_empty(shard_bytes)  # aligned host memory: written in place, as host copies are
    source.copy_(torch.randint(0, 256, (shard_bytes,), dtype=torch.uint8))
    unaligned = torch.empty(shard_bytes + 64, dtype=torch.uint8)[64:]  # goes through a staging copy
    unaligned.copy_(source)
    host_budget = (window + 2) * shard_bytes
    samples: dict[str, list[float]] = {"write": [], "read": [], "raw_write": [], "raw_read": [], "write_staged": []}
    with TierStore(str(workdir), aio, TierBudgets(host_bytes=host_budget)) as store:
        for handle in [store.put(key, source, "nvme") for key in keys]:  # slots laid out once, then overwritten
            handle.wait()
        check_us = identity_check_us(store)
        path, first, _ = store.location(keys[0])
        if store.location(keys[-1])[1] != first + size - shard_bytes:
            raise RuntimeError("the shards' slots are not one contiguous region; fio would measure another one")
        runs = {
            "write": lambda: store_write_gbps(store, keys, source),
            "write_staged": lambda: store_write_gbps(store, keys, unaligned),
            "read": lambda: store_read_gbps(store, keys, shard_bytes, window),
            # fio reads and writes the very same region of the swap file: same blocks, same layout
            "raw_write": lambda: fio_gbps(path, first, "write", size, aio.block_size, fio_depth),
            "raw_read": lambda: fio_gbps(path, first, "read", size, aio.block_size, fio_depth),
        }
        for r in range(repeats):
            writes, reads = ["raw_write", "write", "write_staged"], ["raw_read", "read"]
            if r % 2:  # alternate who goes first: the disk drifts within a repeat too
                writes, reads = writes[::-1], reads[::-1]
            for name in writes + reads:
                if use_fio or not name.startswith("raw_"):
                    samples[name].append(runs[name]())
                if name == "raw_write" and use_fio:
                    # fio wrote its own bytes over the shards: put them back (untimed), or the store's verified
                    # reads would rightly refuse them
                    store_write_gbps(store, keys, source)
        store_write_gbps(store, keys, unaligned)  # new contents through the staging path, then check them
        for key in {keys[0], keys[len(keys) // 2], keys[-1]}:
            if not torch.equal(store.fetch(key, "host").wait(), unaligned):
                raise RuntimeError(f"shard {key} read back different bytes than were written")
            store.release(key, "host")
        backend = store.backend
    med = {name: statistics.median(values) if values else None for name, values in samples.items()}

    def fraction(kind: str) -> tuple[float | None, float | None]:
        if med[f"raw_{kind}"] is None:
            return None, None
        paired = [s / r for s, r in zip(samples[kind], samples[f"raw_{kind}"], strict=True)]
        return round(med[kind] / med[f"raw_{kind}"], 3), round(statistics.median(paired), 3)

    (write_fraction, write_paired), (read_fraction, read_paired) = fraction("write"), fraction("read")
    return {
        "shard_mib": shard_bytes / MiB,
        "shards": len(keys),
        "bytes": size,
        "write_gbps": round(med["write"], 3),
        "read_gbps": round(med["read"], 3),
        "raw_write_gbps": None if med["raw_write"] is None else round(med["raw_write"], 3),
        "raw_read_gbps": None if med["raw_read"] is None else round(med["raw_read"], 3),
        "fraction_of_raw_write": write_fraction,
        "fraction_of_raw_read": read_fraction,
        "paired_fraction_write": write_paired,  # median over repeats of store / the fio run beside it
        "paired_fraction_read": read_paired,
        "write_staged_gbps": round(med["write_staged"], 3),
        "identity_check_us": round(check_us, 2),
        "prefetch_window": window,
        "host_budget_bytes": host_budget,
        "backend": backend,
        "samples_gbps": {name: [round(v, 3) for v in values] for name, values in samples.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=2.0, help="bytes written and read per run")
    parser.add_argument("--shard-mib", type=float, nargs="+", default=[1, 8, 64])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved store/fio runs; medians reported")
    parser.add_argument("--dir", default=None, help="a directory on the disk to measure (default: the repo's)")
    parser.add_argument("--window-mib", type=float, default=32, help="bytes prefetched ahead while reading")
    parser.add_argument("--fio-iodepth", type=int, default=32)
    parser.add_argument("--aio", default="{}", help="aio section as JSON, e.g. '{\"queue_depth\": 16}'")
    parser.add_argument(
        "--checksum-mib", type=float, nargs="+", default=[1, 256], help="buffers the checksum's speed is measured on"
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)

    aio = parse_section(AioConfig, json.loads(args.aio), "aio")
    fio = fio_available()
    base = Path(args.dir) if args.dir else Path(__file__).resolve().parent.parent
    workdir = Path(tempfile.mkdtemp(prefix=".bench-swap-", dir=base))
    results = {}
    try:
        for shard_mib in args.shard_mib:
            shard_bytes = int(shard_mib * MiB)
            res = bench_shard_size(
                workdir,
                aio,
                shard_bytes,
                int(args.size_gib * (1 << 30)),
                args.repeats,
                max(2, int(args.window_mib * MiB) // shard_bytes),
                args.fio_iodepth,
                fio is not None,
            )
            results[f"{shard_mib:g}"] = res
            if not args.json:
                print(
                    f"{shard_mib:g} MiB shards: " + json.dumps({k: v for k, v in res.items() if k != "samples_gbps"}),
                    file=sys.stderr,
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    checksum = {
        "verified": True,
        "algorithm": "crc32c",
        "path": resolve_crc32c_path(),
        "gbps_one_thread": {  # per path, per buffer size in MiB
            p: {f"{mib:g}": round(checksum_gbps(p, int(mib * MiB), args.repeats), 2) for mib in args.checksum_mib}
            for p in supported_crc32c_paths()
        },
    }
    headline = results.get("8") or next(iter(results.values()))
    out = {
        **{
            k: headline[k]
            for k in (
                "write_gbps",
                "read_gbps",
                "raw_write_gbps",
                "raw_read_gbps",
                "fraction_of_raw_write",
                "fraction_of_raw_read",
                "paired_fraction_write",
                "paired_fraction_read",
                "backend",
            )
        },
        "identity_check_us": headline["identity_check_us"],
        "checksum": checksum,
        "headline_shard_mib": headline["shard_mib"],
        "per_shard_mib": results,
        "aio": dataclasses.asdict(aio),
        "size_gib": args.size_gib,
        "repeats": args.repeats,
        "fio": fio or "not installed (apt-get install fio): raw_* and fraction_* are null",
        "fio_settings": {
            "ioengine": "libaio",
            "bs": aio.block_size,
            "iodepth": args.fio_iodepth,
            "direct": 1,
            "rw": "write/read (sequential)",
            "target": "the shards' region of the store's swap file",
        },
        "directory": str(base),
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
