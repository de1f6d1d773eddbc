"""The diagnosis fires on deliberately starved runs, names the setting and its evidence, and is silent
on a well-tuned one. The runs are synthetic timelines (`infinity.profiler.synthetic`) with known causes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from infinity.profiler.analysis import summarize
from infinity.profiler.diagnosis import Diagnosis, diagnose
from infinity.profiler.synthetic import SCENARIOS, Scenario, write_scenario
from infinity.profiler.traces import load_traces


def _diagnose(tmp_path: Path, scenario: Scenario, ranks: int = 1) -> Diagnosis:
    for rank in range(ranks):
        write_scenario(str(tmp_path), scenario, rank=rank, world_size=ranks)
    traces = load_traces([tmp_path])
    return diagnose(summarize(traces), traces)


def _settings(d: Diagnosis) -> dict[str, str]:
    return {r.setting: r.direction for r in d.recommendations}


@pytest.mark.parametrize("ranks", [1, 2])
def test_well_tuned_run_gets_no_recommendation(tmp_path: Path, ranks: int) -> None:
    d = _diagnose(tmp_path, SCENARIOS["tuned"], ranks)
    assert d.recommendations == [] and d.verdict.startswith("no change needed")


def test_starved_run_one_buffer_queue_depth_one_gets_buffers_and_queue_depth(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, SCENARIOS["starved"])
    assert _settings(d) == {"offload_param.buffer_count": "raise", "aio.queue_depth": "raise"}
    by = {r.setting: r for r in d.recommendations}
    assert "exhausted 120 times in 3 step(s)" in by["offload_param.buffer_count"].evidence
    assert by["offload_param.buffer_count"].current == 1
    assert "0.12 of the raw disk's 2.00 GB/s" in by["aio.queue_depth"].evidence


def test_reads_issued_too_late_with_an_idle_queue_raise_the_prefetch_bucket(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, SCENARIOS["late_prefetch"])
    assert _settings(d) == {"stage3_prefetch_bucket_size": "raise"}
    evidence = d.recommendations[0].evidence
    assert "46% of forward stalled on NVMe reads" in evidence and "aio.queue_depth=8" in evidence


def test_queue_idleness_is_estimated_from_moves_without_queue_records(tmp_path: Path) -> None:
    write_scenario(str(tmp_path), SCENARIOS["late_prefetch"])
    path = tmp_path / "trace_rank0.jsonl"
    path.write_text("".join(line for line in path.read_text().splitlines(True) if '"type":"queue"' not in line))
    traces = load_traces([tmp_path])
    d = diagnose(summarize(traces), traces)
    assert _settings(d) == {"stage3_prefetch_bucket_size": "raise"} and "estimated" in d.recommendations[0].evidence


def test_a_saturated_disk_at_full_speed_keeps_more_in_host_memory(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, SCENARIOS["disk_bound"])
    assert _settings(d) == {"offload_param.max_in_cpu": "raise"}
    assert "0.90 of raw disk bandwidth" in d.recommendations[0].evidence


def test_slow_disk_without_stalls_raises_queue_depth_then_threads(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, SCENARIOS["slow_disk"])
    assert _settings(d) == {"aio.queue_depth": "raise"}
    assert "reads ran at 0.50 GB/s while busy, 0.25 of the raw disk's 2.00 GB/s" in d.recommendations[0].evidence
    deep = dataclasses.replace(SCENARIOS["slow_disk"], queue_depth=64)
    assert _settings(_diagnose(tmp_path / "deep", deep)) == {"aio.intra_op_parallelism": "raise"}


def test_stalls_on_all_gather_raise_the_prefetch_bucket(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, SCENARIOS["gather_bound"])
    assert _settings(d) == {"stage3_prefetch_bucket_size": "raise"}
    assert "stalled on all-gather collectives" in d.recommendations[0].evidence


def test_unknown_raw_disk_skips_the_disk_check_with_a_note(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, dataclasses.replace(SCENARIOS["slow_disk"], raw_read_gbps=None))
    assert d.recommendations == [] and any("raw disk bandwidth unknown" in n for n in d.notes)


def test_rare_pool_exhaustion_is_not_a_finding(tmp_path: Path) -> None:
    d = _diagnose(tmp_path, dataclasses.replace(SCENARIOS["tuned"], pool_exhausted_per_step=0, steps=3))
    assert d.recommendations == []
    d = _diagnose(tmp_path / "b", dataclasses.replace(SCENARIOS["tuned"], pool_exhausted_per_step=1, steps=3))
    assert _settings(d) == {"offload_param.buffer_count": "raise"}


def test_optimizer_stalled_on_nvme_reads_turns_on_pipelined_reads(tmp_path: Path) -> None:
    from infinity.profiler import TraceWriter
    from infinity.profiler.synthetic import settings_for

    settings = settings_for(SCENARIOS["tuned"])
    with TraceWriter(tmp_path, 0, 1, settings) as w:
        w.begin_step(0, 0)
        w.set_phase("optimizer", 100)
        w.stall("b0", 100, 150, "nvme->host")
        w.end_step(0, 200)
    traces = load_traces([tmp_path])
    d = diagnose(summarize(traces), traces)
    assert _settings(d) == {"offload_optimizer.pipeline_read": "set true"}
    assert "50% of the optimizer step stalled on NVMe reads" in d.recommendations[0].evidence
    settings["offload_optimizer"]["pipeline_read"] = True
    with TraceWriter(tmp_path / "on", 0, 1, settings) as w:
        w.begin_step(0, 0)
        w.set_phase("optimizer", 100)
        w.stall("b0", 100, 150, "nvme->host")
        w.end_step(0, 200)
    traces = load_traces([tmp_path / "on"])
    assert _settings(diagnose(summarize(traces), traces)) == {"offload_optimizer.buffer_count": "raise"}
