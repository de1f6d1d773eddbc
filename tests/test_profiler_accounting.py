"""Accounting: live bytes reach the store's high-water mark (and the report says when sampled ones do not),
waits are labelled by what was waited on, and a one-rank trace never shows a collective."""

from __future__ import annotations

from pathlib import Path

import pytest
from trace_edits import reseal

from infinity.profiler import TraceWriter
from infinity.profiler.accounting import account
from infinity.profiler.analysis import summarize, validate
from infinity.profiler.attribution import attribute_stalls
from infinity.profiler.report import build_report
from infinity.profiler.synthetic import SCENARIOS, settings_for, write_scenario
from infinity.profiler.traces import load_traces

pytestmark = pytest.mark.unit

GB = 1_000_000_000


def _host_changes(w: TraceWriter, changes: list[tuple[int, str, int]]) -> int:
    """Apply (t, holder, delta) changes, recording `held` and `live` at each; returns the highest total."""
    held: dict[str, int] = {}
    high = 0
    for t, holder, delta in changes:
        held[holder] = held.get(holder, 0) + delta
        total = sum(held.values())
        high = max(high, total)
        w.held("host", holder, held[holder], t)
        w.live("host", total, t)
    return high


CHANGES = [(10, "param", 2 * GB), (20, "optimizer", 3 * GB), (25, "staging", GB), (30, "staging", -GB),
           (40, "param", -2 * GB), (60, "optimizer", -3 * GB)]  # fmt: skip  # peak 6 GB over [25, 30)


def test_live_bytes_recorded_at_every_change_reach_the_stores_high_water_mark(tmp_path: Path) -> None:
    with TraceWriter(tmp_path, 0, 1, {}) as w:
        w.begin_step(0, 0)
        high = _host_changes(w, CHANGES)
        w.peak("host", 6 * GB, 100)  # what the store's high_water_bytes("host") said over the step
        w.end_step(0, 100)
    traces = load_traces([tmp_path])
    acc = account(traces)
    assert high == acc.live_peak["host"] == acc.store_peak["host"] == 6 * GB
    assert summarize(traces).total.peak_live["host"] == 6 * GB
    assert acc.held_peak["host"] == {"param": 2 * GB, "optimizer": 3 * GB, "staging": GB}
    assert acc.problems() == []


def test_live_bytes_sampled_at_phase_changes_miss_the_peak_and_the_report_says_so(tmp_path: Path) -> None:
    with TraceWriter(tmp_path, 0, 1, {}) as w:  # as the engine records today: a level per phase change
        w.begin_step(0, 0)
        w.live("host", 0, 0)
        w.set_phase("backward", 50)
        w.live("host", 3 * GB, 50)
        w.set_phase("optimizer", 80)
        w.live("host", 0, 80)
        w.peak("host", 6 * GB, 100)
        w.end_step(0, 100)
    problems = account(load_traces([tmp_path])).problems()
    assert len(problems) == 1
    assert "peak at 3.000 GB in the trace but the store's high-water mark is 6.000 GB" in problems[0]
    assert "not recorded at every change" in build_report([tmp_path], plots=False).text


def test_synthetic_host_memory_peaks_where_the_store_says(tmp_path: Path) -> None:
    write_scenario(str(tmp_path), SCENARIOS["clipped"])
    acc = account(load_traces([tmp_path]))
    assert acc.live_peak["host"] == acc.store_peak["host"] > 0 and acc.problems() == []


def test_one_rank_writer_records_no_collective_and_labels_gather_waits_by_the_move(tmp_path: Path) -> None:
    settings = settings_for(SCENARIOS["tuned"])  # parameters on NVMe
    with TraceWriter(tmp_path, 0, 1, settings) as w:
        w.begin_step(0, 0)
        w.collective("all-gather", "b0", 100, 0, 10)
        w.stall("b0", 0, 10, "all-gather")
        w.end_step(0, 20)
    trace = load_traces([tmp_path])[0]
    assert trace.of("collective") == [] and [r["waited_on"] for r in trace.of("stall")] == ["nvme->host"]
    assert validate([trace]) == []
    assert '"all-gather"' not in Path(trace.path).read_text()


def test_a_one_rank_trace_with_a_collective_is_a_problem(tmp_path: Path) -> None:
    with TraceWriter(tmp_path, 0, 2, {}) as w:  # written as if by two ranks...
        w.begin_step(0, 0)
        w.collective("all-gather", "b0", 100, 0, 10)
        w.end_step(0, 20)
    path = Path(w.path)
    path.write_text(reseal(path.read_text().replace('"world_size":2', '"world_size":1', 1)))  # ...read as one
    problems = validate(load_traces([path]))
    assert any("a one-rank trace has 1 collective record(s)" in p for p in problems)


def _stall_trace(path: Path, world: int) -> list[dict]:
    with TraceWriter(path, 0, world, settings_for(SCENARIOS["tuned"])) as w:
        w.begin_step(0, 0)
        w.move("('b0#0', 'param')", "b0", 100, "nvme", "host", 0, 60)  # the read ends 60 ns into the stall
        w.move("('b0#0', 'param')", "b0", 100, "host", "device", 60, 80)
        w.move("('b0#0', 'grad')", "b0", 100, "device", "host", 10, 30)  # away from compute: not waited on
        w.collective("all-gather", "b0", 200, 80, 100)
        w.stall("b0", 0, 100, "all-gather")
        w.end_step(0, 120)
    traces = load_traces([path])
    attribute_stalls(traces)
    return [(r["start_ns"], r["end_ns"], r["waited_on"]) for r in traces[0].of("stall")]


def test_a_stall_is_split_at_the_ends_of_the_moves_it_waited_for(tmp_path: Path) -> None:
    assert _stall_trace(tmp_path / "two", 2) == [(0, 60, "nvme->host"), (60, 80, "host->device"),
                                                 (80, 100, "all-gather")]  # fmt: skip
    # one rank: no all-gather happens; the time after the copy is the copy's stage
    assert _stall_trace(tmp_path / "one", 1) == [(0, 60, "nvme->host"), (60, 100, "host->device")]


def test_attribution_is_idempotent(tmp_path: Path) -> None:
    write_scenario(str(tmp_path), SCENARIOS["late_prefetch"])
    traces = load_traces([tmp_path])
    attribute_stalls(traces)
    once = list(traces[0].of("stall"))
    assert attribute_stalls(traces) == 0 and traces[0].of("stall") == once


def test_a_phase_counts_only_the_stalls_inside_its_span(tmp_path: Path) -> None:
    """The last deferred step, settled after the last step's end (before a checkpoint), is recorded in that
    step's optimizer phase but after the phase closed: the phase's stall time is what falls inside it (a
    user's report showed an optimizer phase of 0.6 ms with 5.1 ms of stalls)."""
    with TraceWriter(tmp_path, 0, 1, settings_for(SCENARIOS["tuned"])) as w:
        w.begin_step(0, 0)
        w.set_phase("optimizer", 100)
        w.stall("b0", 110, 130, "nvme->host")  # inside
        w.end_step(0, 150)
        w.stall("b1", 140, 160, "nvme->host")  # half inside
        w.stall("b2", 200, 900, "host->nvme")  # after: the settling of the last step
    summary = summarize(load_traces([tmp_path]))
    window = summary.steps[0].phases["optimizer"]
    assert (window.wall_ns, window.stall_ns) == (50, 30)
    assert window.stall_by_wait == {"nvme->host": 30}
    assert summary.phases["optimizer"].stall_ns == 30
