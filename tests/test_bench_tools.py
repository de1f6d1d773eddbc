"""The benchmarks' own arithmetic (tools/benchlib): the out-of-core bound, rank merging, model shapes,
and one run of tools/bench_train.py in which infinity trains like plain PyTorch."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

from benchlib import scale_bound, scale_disk, shapes  # noqa: E402
from benchlib.launch import merge_ranks  # noqa: E402

from infinity.models.llama import Llama  # noqa: E402
from infinity.profiler import analysis  # noqa: E402
from infinity.profiler.traces import load_traces  # noqa: E402

P = 1000


def test_fp32_bound_reads_master_and_moments_once_and_writes_them_once():
    got = scale_bound.min_step_bytes(P, compute_bytes=4, moments="fp32")
    # by hand: forward reads 4 B params; backward + step read the fp32 master (= params) and m, v (4 + 4 + 4);
    # the step writes master, m, v (12); no separate shard, no gradients
    assert got["read_bytes"] == (4 + 12) * P and got["write_bytes"] == 12 * P
    assert got["bytes_per_param"] == 28
    assert got["unfused_read_bytes"] == (4 + 4 + 12) * P


def test_bf16_bound_with_8bit_moments_writes_the_16_bit_shard_too():
    got = scale_bound.min_step_bytes(P * 256, compute_bytes=2, moments="8bit")
    n = P * 256
    moments = 2 * n + 2 * 4 * (n // 256)  # one byte per element per moment, one fp32 scale per 256 per moment
    assert got["read_bytes"] == 2 * n + 4 * n + moments
    assert got["write_bytes"] == 4 * n + moments + 2 * n
    assert got["parts"]["gradients"] == 0
    assert scale_bound.min_disk_bytes_per_param(2, "8bit") == 4 + moments / n + 2


def test_io_bound_adds_reads_and_writes_on_one_disk_and_overlap_takes_the_larger():
    got = scale_bound.io_bound(2e9, 1e9, read_gbps=2.0, write_gbps=0.5)
    assert got["io_s"] == pytest.approx(1.0 + 2.0)
    assert got["io_s_overlap"] == pytest.approx(2.0)


def _rank(rank: int, times: list[float], losses: list[float], rss: int) -> dict:
    steps = [{"step_s": t, "loss": loss, "cpu_s": t, "forward_s": t / 4, "backward_s": t / 2, "optimizer_s": t / 4}
             for t, loss in zip(times, losses, strict=True)]  # fmt: skip
    record = {"rank": rank, "steps": steps, "threads": 1, "init_s": 1.0 + rank, "model_params": 10}
    for key in ("rss_at_start_bytes", "rss_after_build_bytes", "rss_after_setup_bytes", "peak_rss_after_setup_bytes",
                "rss_after_steps_bytes", "peak_rss_bytes"):  # fmt: skip
        record[key] = rss
    return record


def test_a_step_lasts_as_long_as_its_slowest_rank_and_its_loss_is_the_ranks_mean():
    spec = {"warmup": 1, "batch": 4, "seq": 8}
    ranks = [_rank(0, [9.0, 1.0, 3.0, 2.0], [4.0, 3.0, 2.0, 1.0], 100),
             _rank(1, [9.0, 2.0, 1.0, 2.5], [6.0, 5.0, 4.0, 3.0], 200)]  # fmt: skip
    got = merge_ranks(ranks, spec)
    assert got["step_times_s"] == [2.0, 3.0, 2.5]  # the warm-up left out
    assert got["step_s"] == 2.5 and got["tokens_per_s"] == 4 * 8 / 2.5
    assert got["losses"] == [5.0, 4.0, 3.0, 2.0]
    assert got["peak_rss_bytes"] == [100, 200] and got["max_peak_rss_bytes"] == 200
    assert got["init_s"] == 2.0


def test_seven_billion_target_builds_a_llama_of_at_least_6_7e9_parameters():
    cfg, _ = shapes.choose_shape("llama", 7e9, None, 16)
    with torch.device("meta"):
        model = Llama(cfg)
    count = sum(p.numel() for p in model.parameters())
    assert count == shapes.count("llama", cfg) and count >= 6.7e9
    assert shapes.largest_block_params("llama", cfg) == sum(p.numel() for p in model.layers[0].parameters())


def test_bench_scale_disk_check_asks_for_the_swap_the_7e9_8bit_run_makes():
    cfg, _ = shapes.choose_shape("llama", 7e9, None, 16)
    n = shapes.count("llama", cfg)
    need = scale_disk.disk_need("llama", cfg, 4, "8bit", 2 * 2**30, clip=False)
    # by hand, per parameter: fp32 master that is the parameter slot (4 B), 8-bit moments (2 B and two fp32 scales
    # per 256 elements); stepped during backward: no gradient slot
    assert need["swap_bytes"] == pytest.approx(n * (4 + 2 + 8 / 256), rel=1e-3)
    assert need["total_bytes"] == need["swap_bytes"] + scale_disk.MARGIN_BYTES < 50e9  # fits ~72 GB free
    clipped = scale_disk.disk_need("llama", cfg, 4, "8bit", 2 * 2**30, clip=True)
    assert clipped["swap_bytes"] - need["swap_bytes"] == pytest.approx(4 * n, rel=1e-3)  # gradients wait on NVMe


def test_bench_scale_profile_records_the_timed_steps_only(tmp_path):
    import bench_scale

    from infinity.config import load_config

    args = bench_scale.parse_args(["--params", "3e9", "--profile", str(tmp_path / "traces")])
    cfg = load_config(bench_scale.engine_config(args, tmp_path))
    assert cfg.profiler.enabled and cfg.profiler.path == str(tmp_path / "traces")
    assert cfg.profiler.start_step == 2  # the warm-ups are steps 0 and 1
    unprofiled = bench_scale.engine_config(bench_scale.parse_args(["--params", "3e9"]), tmp_path)
    assert load_config(unprofiled).profiler.enabled is False
    assert bench_scale.parse_args(["--params", "3e9", "--warmup", "0"]).warmup == 0
    for bad in (["--warmup", "-1"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            bench_scale.parse_args(["--params", "3e9", *bad])


def test_bench_scale_zero_keys_join_the_sections_they_name(tmp_path):
    import bench_scale

    from infinity.config import load_config

    extra = '{"offload_optimizer": {"buffer_count": 8}, "sub_group_size": 1000000}'
    cfg = load_config(bench_scale.engine_config(bench_scale.parse_args(["--params", "3e9", "--zero", extra]), tmp_path))
    z = cfg.zero_optimization
    assert z.offload_optimizer.buffer_count == 8 and z.sub_group_size == 1_000_000
    assert z.offload_optimizer.device == "nvme" and z.offload_optimizer.nvme_path == str(tmp_path)  # kept
    for bad in (["--zero", "[1]"], ["--zero", "{oops"], ["--aio", "8"]):
        with pytest.raises(SystemExit):
            bench_scale.parse_args(["--params", "3e9", *bad])


def test_bench_train_runs_infinity_beside_plain_pytorch_with_the_same_losses(tmp_path):
    """...and with --profile, infinity's timed steps leave swap traces that the profiler reads."""
    scratch, profile = tmp_path / "scratch", tmp_path / "profile"
    scratch.mkdir()
    cmd = [sys.executable, str(TOOLS / "bench_train.py"), "--model-size", "tiny", "--seq", "32", "--steps", "2",
           "--warmup", "1", "--configs", "plain,infinity_z3_cpu", "--nvme-path", str(scratch),
           "--profile", str(profile)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    plain, ours = summary["configs"]["plain"], summary["configs"]["infinity_z3_cpu"]
    assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert len(ours["step_times_s"]) == 2 and ours["ratio_to_plain"] > 0
    assert all(b >= a for a, b in zip(ours["rss_after_setup_bytes"], ours["peak_rss_bytes"], strict=True))
    assert not list(scratch.iterdir()), "the run's scratch folder is removed"
    assert [p.name for p in profile.iterdir()] == ["infinity_z3_cpu"]  # infinity only
    traces = load_traces(sorted((profile / "infinity_z3_cpu").glob("trace_rank*.jsonl")))
    assert len(traces) == 1 and analysis.validate(traces) == []
    assert sorted({r["step"] for r in traces[0].records["step"]}) == [1, 2]  # the timed steps, not the warm-up


def test_bench_memory_reports_the_kept_buffers_apart_from_the_sharded_state(tmp_path):
    """Two ranks keep gathered blocks' memory between steps (one rank gathers nothing); the summary reports it
    per rank and the state ratio without it."""
    cmd = [sys.executable, str(TOOLS / "bench_memory.py"), "--n-embd", "64", "--n-layer", "2", "--n-head", "2",
           "--steps", "2", "--configs", "infinity_z3_none"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    many, one = summary["rows"]["infinity_z3_none"], summary["rows"]["infinity_z3_none@1rank"]
    assert len(many["kept_buffer_bytes"]) == 2 and min(many["kept_buffer_bytes"]) > 0
    assert one["kept_buffer_bytes"] == [0]
    sharded = max(s - k for s, k in zip(many["state_bytes"], many["kept_buffer_bytes"], strict=True))
    assert summary["infinity_sharded_state_ratio"] == sharded / max(one["state_bytes"])
    assert summary["state_ratio"] == {"infinity_z3_none": summary["infinity_state_ratio"]}
    if platform.libc_ver()[0] == "glibc":  # glibc's mallinfo2: live bytes, apart from malloc's cache
        for row in (many, one):
            assert [s - live for s, live in zip(row["state_bytes"], row["live_state_bytes"], strict=True)] == row[
                "malloc_kept_bytes"
            ]
        model = max(v - k for v, k in zip(many["live_state_bytes"], many["kept_buffer_bytes"], strict=True))
        assert summary["infinity_model_state_ratio"] == model / max(one["live_state_bytes"])
        # one rank holds the fp32 weights, gradients and both Adam moments whole: 16 bytes a parameter at least
        assert min(one["live_state_bytes"]) >= 16 * one["model_params"]
    assert not list(tmp_path.iterdir()), "the run's scratch folder is removed"
