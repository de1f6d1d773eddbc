"""The engine's profiler: real traces from NVMe training, per rank, well formed and consistent with the
engine's own byte counts; nothing recorded when it is off."""

from __future__ import annotations

import pytest
from dist import run_distributed
from harness import config
from toy_models import batches, make_model

import infinity
from infinity.profiler import analysis
from infinity.profiler.report import build_report
from infinity.profiler.traces import load_traces

STEPS = 3


def profiled_run(nvme_path: str, trace_dir: str | None) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(micro_bs=2, persistence=64, offload_param="nvme", offload_optimizer="nvme", nvme_path=nvme_path)
    if trace_dir is not None:
        cfg["profiler"] = {"enabled": True, "path": trace_dir, "start_step": 0, "end_step": STEPS - 1}
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    data = batches("gpt", 2, rank=rank, world_size=world)
    for _ in range(STEPS):
        x, y = next(data)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    result = {
        "rank": rank,
        "bytes_moved": engine.bytes_moved,
        "param_bytes_moved": {"nvme->host": engine.shards.param_bytes_fetched},  # what gathers asked for
        "uses": engine.scheduler.uses,
        "blocks": [b.name for b in engine.blocks],
    }
    engine.close()
    return result


@pytest.mark.parametrize("world", [1, 2])
def test_profiled_nvme_training_leaves_valid_traces_per_rank(tmp_path, world):
    trace_dir = tmp_path / "trace"
    results = run_distributed(profiled_run, world, str(tmp_path), str(trace_dir))
    paths = sorted(trace_dir.glob("trace_rank*.jsonl"))
    assert [p.name for p in paths] == [f"trace_rank{r}.jsonl" for r in range(world)]
    traces = load_traces(paths)
    assert analysis.validate(traces) == []
    for trace, result in zip(traces, results, strict=True):
        kinds = {kind for kind, records in trace.records.items() if records}
        assert trace.meta["rank"] == result["rank"]
        assert {"step", "phase", "move", "stall", "compute", "use", "live", "rss"} <= kinds
        assert ("collective" in kinds) == (world > 1)  # one rank communicates nothing
        raw = trace.meta["raw_disk"]  # the swap directory was probed when the profiler opened
        assert raw["read_gbps"] > 0 and raw["write_gbps"] > 0 and raw["path"] == str(tmp_path)
        assert trace.meta["config"]["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
        # the trace's reads from NVMe are moves the store counted (a read completing after the last step's
        # end is counted, not traced); gathers read at most what they asked for (fp32 keeps a backward
        # gather's host copy cached for the step of the same slot: a hit reads nothing); a CPU-only
        # machine without a device budget computes from host memory
        moves = trace.records["move"]
        nvme_reads = sum(r["bytes"] for r in moves if r["src"] == "nvme" and r["dst"] == "host")
        assert 0 < nvme_reads <= result["bytes_moved"]["nvme->host"]
        param_reads = sum(
            r["bytes"] for r in moves if r["src"] == "nvme" and r["dst"] == "host" and r["key"].endswith("'param')")
        )
        assert 0 < param_reads <= result["param_bytes_moved"]["nvme->host"]
        assert not any(r["dst"] == "device" for r in moves)
        assert len(trace.records["use"]) == result["uses"]
        computed = {(r["block"], r["phase"]) for r in trace.records["compute"]}
        for block in result["blocks"]:
            assert {(block, "forward"), (block, "backward")} <= computed
        assert sorted({r["step"] for r in trace.records["step"]}) == list(range(STEPS))
    report = build_report(paths, out_dir=tmp_path / "report", plots=False)
    assert report.summary.total.moves["nvme->host"].bytes > 0
    assert report.problems == []
    assert report.diagnosis.bound is not None and "step breakdown" in report.text
    assert not [r for r in report.diagnosis.recommendations if "pipeline" in r.setting]


def test_profiler_off_records_nothing(tmp_path):
    trace_dir = tmp_path / "trace"
    run_distributed(profiled_run, 1, str(tmp_path), None)
    assert not trace_dir.exists()
