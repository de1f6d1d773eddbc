"""bench_scale's JSON record: the measured step, bytes and memory beside the bound (`scale_bound`)."""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

from benchlib import scale_bound, shapes
from benchlib.scale_bound import COMPUTE_BYTES

GiB = 1 << 30


def summarize(args: argparse.Namespace, cfg: Any, how: str, out: dict[str, Any], refs: list[dict[str, float]],
              raw_runs: list[dict[str, float]], need: dict[str, Any], free: int, base: Path,
              load: list[float]) -> dict[str, Any]:  # fmt: skip
    """The JSON record: measured figures beside the bound."""
    import torch

    ref = {k: min(r[k] for r in refs) for k in refs[0]}  # the faster run: a lower bound
    params = out["params"]
    timed = out["steps"][args.warmup :]  # parse_args asks for at least one timed step
    step_s = statistics.median(s["step_s"] for s in timed)
    bytes_read = int(statistics.median(s["bytes_read"] for s in timed))
    bytes_written = int(statistics.median(s["bytes_written"] for s in timed))
    pairs = sorted({k for s in timed for k in s["engine_bytes_moved"]})
    compute_s = cfg.n_layer * ref["block_fwd_bwd_s"] + ref["head_fwd_bwd_s"]
    min_bytes = scale_bound.min_step_bytes(params, COMPUTE_BYTES[args.dtype], args.moments)
    result: dict[str, Any] = {
        "params": params,
        "arch": args.arch,
        "shape": shapes.describe(cfg),
        "shape_chosen": how,
        "dtype": args.dtype,
        "moments": args.moments,
        "clip": args.clip,
        "batch": args.batch,
        "seq": args.seq,
        "timed_steps": len(timed),
        "step_s": round(step_s, 3),
        "peak_rss_bytes": out["peak_rss_bytes"],
        "peak_rss_gib": round(out["peak_rss_bytes"] / GiB, 3),
        "disk_bytes_per_param": round(out["swap_bytes_on_disk"]["allocated"] / params, 3),
        "min_disk_bytes_per_param": round(scale_bound.min_disk_bytes_per_param(COMPUTE_BYTES[args.dtype],
                                                                               args.moments), 3),  # fmt: skip
        "moved_bytes_per_param_per_step": round((bytes_read + bytes_written) / params, 3),
        "bytes_read": bytes_read,
        "bytes_written": bytes_written,
        "engine_bytes_moved": {k: int(statistics.median(s["engine_bytes_moved"].get(k, 0) for s in timed))
                               for k in pairs},  # fmt: skip
        "min_bytes": min_bytes,
        "compute_s": round(compute_s, 3),
        "compute_method": "one layer fwd+bwd in plain PyTorch (same width, batch, seq, dtype) x n_layer + "
        "embeddings/final norm/head/loss fwd+bwd once; median of 5, the faster of two runs (before and after "
        "training) in a child process",
        "adam_in_memory_s": round(ref["adam_s_per_elem"] * params, 3),
        "phases_s": {name: round(statistics.median(s[name] for s in timed), 3)
                     for name in ("forward_s", "backward_s", "optimizer_s", "stall_s")},  # fmt: skip
        "init_s": out["init_s"],
        "peak_rss_after_init_bytes": out["peak_rss_after_init_bytes"],
        "sampled_peak_rss": out["sampled_peak_rss"],
        "gc_workaround": out["gc_workaround"],
        "swap_bytes_on_disk": out["swap_bytes_on_disk"],
        "host_budget_bytes": int(args.host_budget_gib * GiB),
        "device_budget_bytes": None if args.device_budget_gib is None else int(args.device_budget_gib * GiB),
        "warmup_steps": args.warmup,
        "steps": [{k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()} for s in out["steps"]],
        "disk_io_during_init": out["disk_io_during_init"],
        "disk_need": need,
        "disk_free_bytes": free,
        "nvme_path": str(base),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "compute_ref_runs": refs,
        "loadavg_1min_before_after": [round(x, 2) for x in load],
    }
    if raw_runs:
        read_gbps = max(r["read_gbps"] for r in raw_runs)
        write_gbps = max(r["write_gbps"] for r in raw_runs)
        bound = scale_bound.io_bound(min_bytes["read_bytes"], min_bytes["write_bytes"], read_gbps, write_gbps)
        moved = scale_bound.io_bound(bytes_read, bytes_written, read_gbps, write_gbps)
        bound_s = max(compute_s, bound["io_s"])
        overlapped_s = max(compute_s, bound["io_s_overlap"])
        result.update(
            raw_read_gbps=read_gbps,
            raw_write_gbps=write_gbps,
            raw_disk_runs=raw_runs,
            fio={"bs": "1M", "iodepth": args.fio_iodepth, "size_bytes": need["fio_bytes"], "direct": 1,
                 "rw": "seq write, then read"},  # fmt: skip
            io_s=round(bound["io_s"], 3),
            io_s_overlap=round(bound["io_s_overlap"], 3),
            bound_s=round(bound_s, 3),
            bound_by="io" if bound["io_s"] >= compute_s else "compute",
            ratio_to_bound=round(step_s / bound_s, 3),
            ratio_to_overlapped_bound=round(step_s / overlapped_s, 3),
            io_s_of_bytes_moved=round(moved["io_s"], 3),  # the bytes actually moved, at fio's bandwidth
        )
    return result
