"""The diagnosis: the verdict on the whole step names the largest avoidable part first (the optimizer
streaming after backward under clipping, with its bytes, bandwidth against the probed disk and the
saving), stays quiet on a run near its bound, and the setting rules fire on deliberately starved runs,
naming the key that changes something and its evidence. The runs are synthetic timelines
(`infinity.profiler.synthetic`) with known causes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from trace_edits import reseal

from infinity.profiler import TraceWriter
from infinity.profiler.analysis import summarize
from infinity.profiler.diagnosis import Diagnosis, diagnose
from infinity.profiler.facts import RunFacts
from infinity.profiler.report import prepare
from infinity.profiler.synthetic import MS, SCENARIOS, Scenario, config_for, settings_for, write_scenario
from infinity.profiler.traces import load_traces
from infinity.profiler.verdict import OVERLAP_FEATURE, _optimizer_cause

pytestmark = pytest.mark.unit

Z = "zero_optimization."


def _diagnose(tmp_path: Path, scenario: Scenario, ranks: int = 1) -> Diagnosis:
    for rank in range(ranks):
        write_scenario(str(tmp_path), scenario, rank=rank, world_size=ranks)
    traces = load_traces([tmp_path])
    assert prepare(traces) == []
    return diagnose(summarize(traces), traces)


def _settings(d: Diagnosis) -> dict[str, str]:
    return {r.setting: r.direction for r in d.recommendations}


# -- the verdict on the whole step ------------------------------------------------------------------


def test_clipped_run_names_the_optimizer_phase_after_backward_and_clipping_first(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, SCENARIOS["clipped"])
    first = d.verdict
    assert first == d.findings[0].headline and first.startswith("optimizer phase after backward: ")
    assert "because gradient_clipping is 1.0" in first
    # the scenario reads 16 blocks x (48 MB state + 16 MB gradient) at 1.8 GB/s against a probed 2.0 GB/s
    assert "1.02 GB read at 1.80 GB/s (0.90 of the probed 2.00 GB/s)" in first
    assert "GB written at 0.90 GB/s (0.90 of the probed 1.00 GB/s)" in first
    saving = d.findings[0].prediction.saving_s
    assert f"expected saving {saving:.3f} s per step" in first and saving > 0
    assert d.findings[0].remedy.startswith(OVERLAP_FEATURE) and "gradient_clipping 0" in d.findings[0].remedy


def test_the_same_run_without_clipping_stays_quiet(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, SCENARIOS["tuned"])  # "clipped" is "tuned" with gradient_clipping 1.0
    assert d.findings == [] and d.recommendations == []
    assert d.verdict.startswith("no change needed: the ") and "within 10% of its bound" in d.verdict


def test_fp16_loss_scaling_is_named_when_it_keeps_the_optimizer_after_backward(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, dataclasses.replace(SCENARIOS["clipped"], gradient_clipping=0.0, fp16=True))
    assert d.findings[0].part == "optimizer phase after backward" and "fp16 loss scaling" in d.verdict


def test_a_step_far_above_its_bound_is_never_no_change_needed(tmp_path: Path) -> None:
    for name in ("clipped", "starved", "late_prefetch"):
        d = _diagnose(tmp_path / name, SCENARIOS[name])
        assert not d.verdict.startswith("no change needed"), name
        step_s = d.breakdown.mean.wall_ns / 1e9
        assert step_s > 1.1 * d.bound.bound_s, name


# -- the setting rules -----------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2])
def test_well_tuned_run_gets_no_recommendation(tmp_path: Path, ranks: int) -> None:
    d = _diagnose(tmp_path, SCENARIOS["tuned"], ranks)
    assert d.recommendations == [] and d.verdict.startswith("no change needed")


def test_starved_run_one_buffer_queue_depth_one_gets_buffers_and_queue_depth(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, SCENARIOS["starved"])
    assert _settings(d) == {Z + "offload_param.buffer_count": "raise", "aio.queue_depth": "raise"}
    by = {r.setting: r for r in d.recommendations}
    buffers = by[Z + "offload_param.buffer_count"]
    assert "exhausted 120 times in 3 step(s)" in buffers.evidence
    # read-ahead now max(1 x 1e8, 4 x 32e6 elements of the largest shard) = 1.28e8; twice that needs 3 buffers
    assert (buffers.current, buffers.value) == (1, 3)
    assert "0.12 of the probed disk's 2.00 GB/s" in by["aio.queue_depth"].evidence
    assert (by["aio.queue_depth"].current, by["aio.queue_depth"].value) == (1, 2)
    assert d.findings[0].part == "NVMe below the disk's speed" and d.findings[0].setting == "aio.queue_depth"


def test_reads_issued_too_late_with_an_idle_queue_raise_the_prefetch_bucket(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, SCENARIOS["late_prefetch"])
    assert _settings(d) == {Z + "stage3_prefetch_bucket_size": "raise"}
    r = d.recommendations[0]
    assert "46% of forward stalled on NVMe reads" in r.evidence and "aio.queue_depth=8" in r.evidence
    assert (r.current, r.value) == (50_000_000, 100_000_000)
    assert d.findings[0].setting == Z + "stage3_prefetch_bucket_size"


def test_late_reads_of_the_parameters_outside_the_blocks_raise_no_prefetch_bucket(tmp_path: Path) -> None:
    """The same stalls on `<persistent>` (or `<root>`), read whole as each pass starts: the bucket fetches blocks
    ahead, not them, so raising it would change nothing (a model whose layers all fall below the persistence
    threshold, e.g. the default job's before its threshold was lowered, was told to double it again and again)."""
    write_scenario(str(tmp_path), SCENARIOS["late_prefetch"])
    path = tmp_path / "trace_rank0.jsonl"
    stall_block = re.compile(r'^(\{"type":"stall","block":)"[^"]*"', re.M)
    path.write_text(reseal(stall_block.sub(r'\1"<persistent>"', path.read_text())))
    traces = load_traces([tmp_path])
    assert prepare(traces) == []
    d = diagnose(summarize(traces), traces)
    assert Z + "stage3_prefetch_bucket_size" not in _settings(d)
    assert any("outside the blocks (<root>, <persistent>)" in n and "no prefetch setting" in n for n in d.notes)


def test_queue_idleness_is_estimated_from_moves_without_queue_records(tmp_path: Path) -> None:
    write_scenario(str(tmp_path), SCENARIOS["late_prefetch"])
    path = tmp_path / "trace_rank0.jsonl"
    path.write_text("".join(line for line in path.read_text().splitlines(True) if '"type":"queue"' not in line))
    traces = load_traces([tmp_path])
    d = diagnose(summarize(traces), traces)
    assert _settings(d) == {Z + "stage3_prefetch_bucket_size": "raise"}
    assert "estimated" in d.recommendations[0].evidence


def test_a_saturated_disk_at_full_speed_keeps_more_in_host_memory_with_the_key_that_sizes_it(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, SCENARIOS["disk_bound"])
    # max_in_cpu (1e9) is above buffer_count x buffer_size (5 x 1e8): raising it would change nothing
    assert _settings(d) == {Z + "offload_param.buffer_count": "raise"}
    assert "0.90 of the probed disk's speed" in d.recommendations[0].evidence
    assert (d.recommendations[0].current, d.recommendations[0].value) == (5, 10)
    budget = dataclasses.replace(SCENARIOS["disk_bound"], host_budget_bytes=2_000_000_000)
    assert _settings(_diagnose(tmp_path / "budget", budget)) == {Z + "host_budget_bytes": "raise"}


def test_a_saturated_disk_reading_optimizer_state_raises_no_parameter_read_ahead(tmp_path: Path) -> None:
    """The same stalls where the bytes read are a deferred step's state (master, moments), not parameters, as in
    a run whose whole model fits in host memory: the parameters' read-ahead would change nothing (a user audit
    applied it and saw the same reads and stalls), so it is a note, not a recommendation."""
    write_scenario(str(tmp_path), SCENARIOS["disk_bound"])
    path = tmp_path / "trace_rank0.jsonl"
    path.write_text(reseal(path.read_text().replace("'param')", "'exp_avg')")))
    traces = load_traces([tmp_path])
    assert prepare(traces) == []
    d = diagnose(summarize(traces), traces)
    assert Z + "offload_param.buffer_count" not in _settings(d)
    assert any("are the optimizer's state" in n and "no parameter read-ahead setting" in n for n in d.notes)


def test_slow_disk_without_stalls_raises_queue_depth_then_threads(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, SCENARIOS["slow_disk"])
    assert _settings(d) == {"aio.queue_depth": "raise"}
    assert "reads ran at 0.50 GB/s while busy, 0.25 of the probed disk's 2.00 GB/s" in d.recommendations[0].evidence
    deep = dataclasses.replace(SCENARIOS["slow_disk"], queue_depth=64)
    assert _settings(_diagnose(tmp_path / "deep", deep)) == {"aio.intra_op_parallelism": "raise"}


def _shared_disk_trace(path: Path, read_bytes: int, write_bytes: int) -> Diagnosis:
    """One 1 s forward computing throughout while NVMe reads and writes run beside each other for all of it, in
    eight moves each, against a probed disk of 2 GB/s reads and 1 GB/s writes."""
    scenario = SCENARIOS["tuned"]
    raw = {"read_gbps": 2.0, "write_gbps": 1.0, "backend": "odirect"}
    with TraceWriter(path, 0, 1, settings_for(scenario), raw_disk=raw, config=config_for(scenario)) as w:
        w.begin_step(0, 0)
        w.compute("b0", 0, 1000 * MS)
        for i in range(8):
            span = (i * 125 * MS, (i + 1) * 125 * MS)
            w.move(f"('b{i}#0', 'exp_avg')", f"b{i}", read_bytes // 8, "nvme", "host", *span)
            w.move(f"('b{i}#0', 'exp_avg_sq')", f"b{i}", write_bytes // 8, "host", "nvme", *span)
        w.end_step(0, 1000 * MS)
    traces = load_traces([path])
    return diagnose(summarize(traces), traces)


def test_reads_and_writes_sharing_a_saturated_disk_recommend_no_aio_setting(tmp_path: Path) -> None:
    """Each direction alone at half the probed speed, but together the disk ran at its full speed (1 GB read at
    2 GB/s and 0.5 GB written at 1 GB/s in the same second): more requests in flight cannot help. A real 3e9
    clipped run showed this (writes at 0.56 of the probe while reads ran beside them) and was told to double
    aio.queue_depth, which on an earlier boot moved that step by no more than the noise (README: 18.99 s at 32
    against 19.82 at 16)."""
    d = _shared_disk_trace(tmp_path / "full", 1_000_000_000, 500_000_000)
    assert not [r for r in d.recommendations if r.setting.startswith("aio.")]
    note = next(n for n in d.notes if "ran at the same time" in n)
    assert "reads ran at 1.00 GB/s while busy, 0.50 of the probed disk's 2.00 GB/s" in note
    assert "writes ran at 0.50 GB/s while busy, 0.50 of the probed disk's 1.00 GB/s" in note
    assert "at 1.00 of its probed speed while busy" in note
    # half the bytes in the same second: the disk had room, so the queue is what held it back
    half = _shared_disk_trace(tmp_path / "half", 500_000_000, 250_000_000)
    assert _settings(half) == {"aio.queue_depth": "raise"}


def test_stalls_on_all_gather_raise_the_prefetch_bucket(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, SCENARIOS["gather_bound"], ranks=2)
    assert _settings(d) == {Z + "stage3_prefetch_bucket_size": "raise"}
    assert "stalled on collectives" in d.recommendations[0].evidence
    assert d.findings[0].part == "collective stalls in forward"


def test_unknown_raw_disk_skips_the_disk_check_with_a_note(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, dataclasses.replace(SCENARIOS["slow_disk"], raw_read_gbps=None))
    assert d.recommendations == [] and any("raw disk bandwidth unknown" in n for n in d.notes)


def test_rare_pool_exhaustion_is_not_a_finding(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, dataclasses.replace(SCENARIOS["tuned"], pool_exhausted_per_step=0, steps=3))
    assert d.recommendations == []
    d = _diagnose(tmp_path / "b", dataclasses.replace(SCENARIOS["tuned"], pool_exhausted_per_step=1, steps=3))
    assert _settings(d) == {Z + "offload_param.buffer_count": "raise"}


def _optimizer_stall_trace(path: Path, scenario: Scenario) -> Diagnosis:
    """One step whose optimizer phase waits 50 of 100 ns on a read, the disk busy for 10 of them."""
    with TraceWriter(path, 0, 1, settings_for(scenario), config=config_for(scenario)) as w:
        w.begin_step(0, 0)
        w.set_phase("optimizer", 100)
        w.move("('b0#0', 'exp_avg')", "b0", 4096, "nvme", "host", 140, 150)
        w.stall("b0", 100, 150, "nvme->host")
        w.end_step(0, 200)
    traces = load_traces([path])
    return diagnose(summarize(traces), traces)


def test_optimizer_waiting_on_reads_with_the_disk_idle_raises_its_window_never_a_pipeline_key(tmp_path: Path) -> None:
    d = _optimizer_stall_trace(tmp_path, SCENARIOS["tuned"])
    assert _settings(d) == {Z + "offload_optimizer.buffer_count": "raise"}
    r = d.recommendations[0]
    assert "50% of the optimizer step stalled on NVMe reads while the disk was busy for only 10%" in r.evidence
    assert (r.current, r.value) == (4, 8)
    budget = dataclasses.replace(SCENARIOS["tuned"], host_budget_bytes=1 << 30)
    assert _settings(_optimizer_stall_trace(tmp_path / "budget", budget)) == {Z + "host_budget_bytes": "raise"}


def test_an_optimizer_stall_too_small_for_the_step_recommends_nothing(tmp_path: Path) -> None:
    """The same 50 ns optimizer stall with the disk idle, after a 10 us forward: 0.5% of the step, where any
    setting could save less than the smallest part the verdict names (a 3e9 run's 5 ms optimizer phase,
    0.01% of its 38 s step, was told to raise the host budget by 4 GiB)."""
    scenario = dataclasses.replace(SCENARIOS["tuned"], host_budget_bytes=1 << 30)
    with TraceWriter(tmp_path, 0, 1, settings_for(scenario), config=config_for(scenario)) as w:
        w.begin_step(0, 0)
        w.compute("b0", 0, 10_000)
        w.set_phase("optimizer", 10_000)
        w.move("('b0#0', 'exp_avg')", "b0", 4096, "nvme", "host", 10_040, 10_050)
        w.stall("b0", 10_000, 10_050, "nvme->host")
        w.end_step(0, 10_100)
    traces = load_traces([tmp_path])
    assert diagnose(summarize(traces), traces).recommendations == []


def test_no_recommendation_ever_names_a_pipeline_key(tmp_path: Path) -> None:
    for name, scenario in SCENARIOS.items():
        d = _diagnose(tmp_path / name, scenario, ranks=2 if name == "gather_bound" else 1)
        assert not [r for r in d.recommendations if "pipeline" in r.setting], name
        assert not [f for f in d.findings if "pipeline" in f.remedy], name


def test_a_host_optimizer_after_a_gpu_backward_is_named_with_its_saving(tmp_path: Path) -> None:
    """Forward and backward 400 ms each on the GPU, then 8 shards of host Adam, 25 ms each: the optimizer
    could run beside backward (max(400, 200) ms) leaving one window's half (2 of 8 shards) after it."""
    config = {"zero_optimization": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu",
                                                                                             "buffer_count": 4}}}
    ms = 1_000_000
    with TraceWriter(tmp_path, 0, 1, {"offload_param": {"device": "cpu"}}, config=config, device="cuda") as w:
        w.begin_step(0, 0)
        for phase, start, each in (("forward", 0, 50), ("backward", 400, 50), ("optimizer", 800, 25)):
            w.set_phase(phase, start * ms)
            for i in range(8):
                w.compute(f"b{i}", (start + i * each) * ms, (start + (i + 1) * each) * ms)
        w.end_step(0, 1000 * ms)
    traces = load_traces([tmp_path])
    d = diagnose(summarize(traces), traces)
    assert d.bound.bound_s == pytest.approx(0.8)  # the host arithmetic can run beside the GPU's 800 ms
    f = d.findings[0]
    assert f.part == "optimizer phase after backward" and "offload_optimizer.device cpu" in f.cause
    assert f.prediction.predicted_step_s == pytest.approx(0.400 + 0.400 + 0.050)


@pytest.mark.parametrize(
    "zero,world,cuda,says",
    [
        ({"stage": 3, "offload_param": {"device": "nvme"}}, 1, False, "the trace is from an older version"),
        ({"stage": 3, "offload_param": {"device": "none"}}, 2, False, "the trace is from an older version"),
        ({"stage": 3, "offload_param": {"device": "none"}}, 1, False, "the trace is from an older version"),
        ({"stage": 2, "offload_param": {"device": "none"}}, 1, False, "the trace is from an older version"),
        ({"stage": 2, "offload_param": {"device": "none"}}, 2, False, "offload_param.device nvme at stage 3"),
        ({"stage": 3, "offload_param": {"device": "none"}}, 1, True, "offload_param.device nvme at stage 3"),
        ({"stage": 3, "device_budget_bytes": 2**30}, 1, False, "offload_param.device nvme at stage 3"),
    ],
)
def test_clipping_names_the_overlap_infinity_has_where_parameters_are_gathered(zero, world, cuda, says) -> None:
    """Under clipping the step overlaps the next forward where parameters are gathered (stage 3, offloaded
    or on several ranks) or one rank computes on the host from resident parameters; resident parameters on
    a GPU (or on a CPU given a device budget of its own), or shared between ranks at stages 1-2, are not, so
    the remedy names the setting."""
    zero = {**zero, "offload_optimizer": {"device": "nvme"}}
    facts = RunFacts({"gradient_clipping": 1.0, "zero_optimization": zero}, world, None, cuda, True)
    cause, remedy = _optimizer_cause(facts)
    assert "gradient_clipping is 1.0" in cause and remedy.startswith(OVERLAP_FEATURE) and says in remedy
    assert "gradient_clipping 0" in remedy


def test_host_parameters_under_a_gpu_are_gathered_so_the_overlap_is_there_already() -> None:
    """One rank on a GPU with offload_param cpu: the parameters live apart from the compute and are gathered,
    so the step is deferred to the next forward (a serial phase means an older trace)."""
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "nvme"}}
    facts = RunFacts({"gradient_clipping": 1.0, "zero_optimization": zero}, 1, None, True, True)
    assert "the trace is from an older version" in _optimizer_cause(facts)[1]


def _forward_step_stall_trace(path: Path, write: tuple[int, int]) -> Diagnosis:
    """One step whose forward (0-100 ns) computes for 60 ns and waits 40 on the optimizer step deferred into
    it, a state write in flight over `write` (start, end ns)."""
    scenario = SCENARIOS["clipped"]
    with TraceWriter(path, 0, 1, settings_for(scenario), config=config_for(scenario)) as w:
        w.begin_step(0, 0)
        w.compute("b0", 0, 30)
        w.stall("b1#0", 30, 70, "optimizer step")
        w.move("('b1#0', 'exp_avg')", "b1", 4096, "host", "nvme", *write)
        w.compute("b1", 70, 100)
        w.set_phase("backward", 100)
        w.compute("b1", 100, 150)
        w.compute("b0", 150, 200)
        w.end_step(0, 200)
    traces = load_traces([path])
    return diagnose(summarize(traces), traces)


def test_a_forward_waiting_on_its_deferred_optimizer_step_with_the_disk_idle_raises_the_optimizer_window(
    tmp_path: Path,
) -> None:
    d = _forward_step_stall_trace(tmp_path / "idle", (50, 60))
    assert _settings(d) == {Z + "offload_optimizer.buffer_count": "raise"}
    r = d.recommendations[0]
    assert (r.current, r.value) == (4, 8)
    assert "40% of forward stalled on the reads and writes of the optimizer step running in it" in r.evidence
    assert "disk was busy for only 10% of forward" in r.evidence
    finding = next(f for f in d.findings if f.part == "optimizer step stalls in forward")
    assert finding.setting == Z + "offload_optimizer.buffer_count" and finding.time_s == pytest.approx(40e-9)
    assert not [f for f in d.findings if f.part.startswith("serial I/O")]
    # the disk busy for the whole forward: a larger window cannot beat it; nothing is recommended
    busy = _forward_step_stall_trace(tmp_path / "busy", (0, 100))
    assert busy.recommendations == []
    assert all(f.setting is None for f in busy.findings)
