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


def profiled_run(
    nvme_path: str, trace_dir: str | None, clip: float = 1.0, host_budget: int | None = None, recompute: bool = True
) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(
        micro_bs=2,
        persistence=64,
        offload_param="nvme",
        offload_optimizer="nvme",
        clip=clip,
        nvme_path=nvme_path,
        extra_zero={"host_budget_bytes": host_budget},
    )
    cfg["zero_optimization"]["offload_optimizer"]["recompute_gradients"] = recompute
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
        "flats": [f.name for f in engine.shards.records],
        "stepped_when_needed": engine.optimizer.stepped_when_needed,
        "stepped_in_backward": engine.optimizer.stepped_in_backward,
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
        # several ranks: waits for the reductions in flight (for the slowest rank's gradients) are stalls
        reductions = [r for r in trace.records["stall"] if r["waited_on"] == "reduce-scatter"]
        assert bool(reductions) == (world > 1) and {r["phase"] for r in reductions} <= {"backward"}
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


@pytest.mark.parametrize(
    "world,clip,host_budget", [(1, 1.0, None), (2, 1.0, None), (2, 0.0, None), (1, 0.0, 256 << 20)]
)
def test_an_optimizer_step_inside_forward_or_backward_records_its_arithmetic_and_waits(
    tmp_path, world, clip, host_budget
):
    """The NVMe optimizer steps inside forward (deferred to the next forward: clipped, or unclipped where the
    gradients fit in host memory) or inside backward (unclipped under a host budget: each shard as its
    gradient arrives). Its waits for state reads are stalls on "optimizer step", and its arithmetic, where no
    block's span covers it, is compute of the flat parameter ("<block>#<group>"), never overlapping the
    blocks' own spans; the report counts those stalls in their phase."""
    trace_dir = tmp_path / "trace"
    results = run_distributed(profiled_run, world, str(tmp_path), str(trace_dir), clip, host_budget)
    traces = load_traces(sorted(trace_dir.glob("trace_rank*.jsonl")))
    assert analysis.validate(traces) == []
    in_forward = host_budget is None
    assert all((r["stepped_when_needed"] > 0) == in_forward != (r["stepped_in_backward"] > 0) for r in results)
    phase = "forward" if in_forward else "backward"
    for trace, result in zip(traces, results, strict=True):
        waits = {r["block"] for r in trace.records["stall"] if r["waited_on"] == "optimizer step"}
        assert waits and waits <= set(result["flats"])
        assert {r["phase"] for r in trace.records["stall"] if r["waited_on"] == "optimizer step"} <= {phase, "backward"}
        arithmetic = {(r["block"], r["phase"], r["step"]) for r in trace.records["compute"] if "#" in r["block"]}
        # the step's arithmetic is never inside a wait labelled as a move of weights (a gather's stall that
        # settled the step owed to its shards used to swallow it as a disk read)
        moves = [s for s in trace.records["stall"] if "->" in s["waited_on"] and s["phase"] != "optimizer"]
        steps = [r for r in trace.records["compute"] if "#" in r["block"] and r["phase"] != "optimizer"]
        assert not [(r["block"], s["block"]) for r in steps for s in moves
                    if s["start_ns"] <= r["start_ns"] and r["end_ns"] <= s["end_ns"]]  # fmt: skip
        if in_forward:  # every shard's deferred step, in the forward of every step after the first
            assert {(f, "forward", s) for f in result["flats"] for s in range(1, STEPS)} <= arithmetic
        else:  # stepped on arrival: inside a block's span, or between them (recorded then)
            assert {phase for _, phase, _ in arithmetic} <= {"backward"}
    report = build_report(sorted(trace_dir.glob("trace_rank*.jsonl")), out_dir=tmp_path / "report", plots=False)
    assert report.problems == []
    assert report.diagnosis.breakdown.mean.phase(phase).stall_ns.get("optimizer step", 0) > 0


def test_a_gradient_replay_is_recorded_as_compute_in_the_forward_that_runs_it(tmp_path):
    """Clipped under a host budget, each block's gradient is recomputed when its deferred step runs in the next
    forward: the trace records that time as compute of "<block> (gradient replay)" in forward, which the
    report's checks accept; backward writes no gradient."""
    trace_dir = tmp_path / "trace"
    (result,) = run_distributed(profiled_run, 1, str(tmp_path), str(trace_dir), 1.0, 256 << 20)
    (trace,) = load_traces(sorted(trace_dir.glob("trace_rank*.jsonl")))
    assert analysis.validate([trace]) == []
    replays = {(r["block"], r["step"]) for r in trace.records["compute"] if r["block"].endswith("(gradient replay)")}
    assert replays == {(f"{b} (gradient replay)", s) for b in result["blocks"] for s in range(1, STEPS)}
    assert {r["phase"] for r in trace.records["compute"] if "(gradient replay)" in r["block"]} == {"forward"}
    grads_written = [r for r in trace.records["move"] if r["key"].endswith("'grad')") and r["dst"] == "nvme"]
    # the blocks' only in the first step, whose gradients are also kept for the replays' trial
    assert {r["block"] for r in grads_written if r["step"] > 0} <= {"<root>", "<persistent>"}
    assert {r["block"] for r in grads_written if r["step"] == 0} >= set(result["blocks"])
    report = build_report(sorted(trace_dir.glob("trace_rank*.jsonl")), out_dir=tmp_path / "report", plots=False)
    assert report.problems == []


@pytest.mark.parametrize("world", [1, 2])
def test_waits_for_gradient_writes_are_recorded_as_disk_write_stalls_of_their_flat(tmp_path, world):
    """Clipped under a host budget, gradients not recomputed wait on NVMe for the step: backward writes each
    flat's and waits for the oldest write when more are in flight than the plan holds. Those waits are stalls on
    host->nvme of the flat written (not compute of the block whose hook waited), and the report counts them
    in backward's disk write stalls."""
    trace_dir = tmp_path / "trace"
    results = run_distributed(profiled_run, world, str(tmp_path), str(trace_dir), 1.0, 256 << 20, False)
    traces = load_traces(sorted(trace_dir.glob("trace_rank*.jsonl")))
    assert analysis.validate(traces) == []
    for trace, result in zip(traces, results, strict=True):
        assert len(result["flats"]) > 2  # more than the writes in flight (half the window of 4): some wait in backward
        writes = [r for r in trace.records["stall"] if r["waited_on"] == "host->nvme"]
        assert {r["block"] for r in writes} <= set(result["flats"])
        assert {r["block"] for r in writes if r["phase"] == "backward"}
    report = build_report(sorted(trace_dir.glob("trace_rank*.jsonl")), out_dir=tmp_path / "report", plots=False)
    assert report.problems == []
    assert report.diagnosis.breakdown.mean.phase("backward").stall_ns.get("disk write", 0) > 0
