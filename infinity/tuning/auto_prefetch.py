"""The "auto" prefetch bucket: enough blocks in flight that reading the next one hides behind compute.

From a profiled trial: a block's parameters take `read_s` to arrive (its mean parameter-read bytes over
the tier pair's busy bandwidth, nvme->host for NVMe-offloaded parameters, host->device for CPU
offload) and `compute_s` to use (the mean forward compute span per block, the shorter of the two
phases, so the harder one to hide reads behind). While one block computes, ceil(read_s / compute_s)
more must already be on their way, plus the one in use:

    bucket elements = ceil(read_s / compute_s + 1) x block elements
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infinity.profiler.analysis import drop_malformed, union_ns
from infinity.profiler.traces import RankTrace

READ_PAIR = {"nvme": "nvme->host", "cpu": "host->device"}


@dataclass(frozen=True)
class PrefetchEvidence:
    """The numbers behind an "auto" prefetch bucket, and the bucket."""

    pair: str
    read_gbps: float  # busy bandwidth of the pair's parameter reads
    block_bytes: float  # mean bytes of one block's parameter read
    read_s: float
    compute_s: float
    blocks_ahead: int
    block_elems: int
    bucket_elems: int

    def __str__(self) -> str:
        return (
            f"parameter reads {self.pair} at {self.read_gbps:.2f} GB/s (busy) take {self.read_s * 1e3:.2f} ms "
            f"per block ({self.block_bytes / 1e6:.2f} MB); forward compute takes {self.compute_s * 1e3:.2f} ms "
            f"per block -> ceil({self.read_s * 1e3:.2f} / {self.compute_s * 1e3:.2f} + 1) = {self.blocks_ahead} "
            f"blocks x {self.block_elems:,} elements = {self.bucket_elems:,} elements"
        )


def _is_param_key(key: str) -> bool:
    return "'param'" in key


def auto_prefetch(traces: list[RankTrace], param_device: str, block_elems: int) -> PrefetchEvidence:
    """The bucket for blocks of `block_elems` from `traces` (their malformed records left out, as the report
    leaves them out); ValueError saying what the traces lack."""
    drop_malformed(traces)
    pair = READ_PAIR.get(param_device)
    if pair is None:
        raise ValueError('parameters live on the device (offload_param.device is "none"): no reads to hide')
    src, dst = pair.split("->")
    read_bytes = read_ns = reads = 0
    compute: list[int] = []
    for trace in traces:
        moves = [
            r
            for r in trace.of("move")
            if r["src"] == src
            and r["dst"] == dst
            and _is_param_key(r["key"])
            and r["phase"] in ("forward", "backward")
            and not r["block"].startswith("<")
        ]
        read_bytes += sum(r["bytes"] for r in moves)
        read_ns += union_ns((r["start_ns"], r["end_ns"]) for r in moves)
        reads += len(moves)
        compute += [
            r["end_ns"] - r["start_ns"]
            for r in trace.of("compute")
            if r["phase"] == "forward" and not r["block"].startswith("<")
        ]
    if not reads or not read_ns:
        raise ValueError(f"the trace has no {pair} parameter reads of blocks")
    if not compute:
        raise ValueError("the trace has no forward compute spans of blocks")
    gbps = read_bytes / read_ns
    block_bytes = read_bytes / reads
    read_s = block_bytes / gbps / 1e9
    compute_s = sum(compute) / len(compute) / 1e9
    ahead = math.ceil(read_s / compute_s + 1)
    return PrefetchEvidence(pair, gbps, block_bytes, read_s, compute_s, ahead, block_elems, ahead * block_elems)
