"""The step breakdown and the what-if predictions, on a hand-built step whose answers are computed here.

One step of 500 ms at one rank (times in ms): forward [0, 100) computes; backward [100, 300) computes
and writes two 10 MB gradients to NVMe over [150, 160) and [250, 260); the optimizer [300, 500) reads
two shards' state (30 MB each) and gradients (10 MB each), steps each (10 ms of Adam), and writes the
state back (30 MB each), waiting on the reads:

    reads   b0 state [300, 360) b0 grad [300, 320)  b1 state [360, 420) b1 grad [360, 380)
    writes  b0 state [380, 440)                      b1 state [440, 500)
    compute b0 [360, 370) b1 [420, 430)     stalls b0 [300, 360) b1 [370, 420)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from infinity.profiler import TraceWriter
from infinity.profiler.breakdown import breakdown
from infinity.profiler.format import DISK_READ
from infinity.profiler.synthetic import SCENARIOS, config_for, settings_for
from infinity.profiler.traces import load_traces
from infinity.profiler.whatif import check, optimizer_overlap, stalls_removed

pytestmark = pytest.mark.unit

MS = 1_000_000
MB = 1_000_000


def _key(block: str, name: str) -> str:
    return str((f"{block}#0", name))


def write_clipped_step(path: Path, step_ms: float = 500, device: str | None = None, forward_stall: bool = False):
    scenario = dataclasses.replace(SCENARIOS["clipped"], window=2)
    w = TraceWriter(path, 0, 1, settings_for(scenario), config=config_for(scenario), device=device)
    t = lambda ms: int(ms * MS)  # noqa: E731
    w.begin_step(0, t(0))
    if forward_stall:  # forward waits 40 ms on a 70 ms read of the first block
        w.move(_key("b0", "param"), "b0", 70 * MB, "nvme", "host", t(-30), t(40))
        w.stall("b0", t(0), t(40), "nvme->host")
        w.compute("b0", t(40), t(100))
    else:
        w.compute("b0", t(0), t(100))
    w.set_phase("backward", t(100))
    w.compute("b1", t(100), t(200))
    w.move(_key("b1", "grad"), "b1", 10 * MB, "host", "nvme", t(150), t(160))
    w.compute("b0", t(200), t(300))
    w.move(_key("b0", "grad"), "b0", 10 * MB, "host", "nvme", t(250), t(260))
    w.set_phase("optimizer", t(300))
    for block, start in (("b0", 300), ("b1", 360)):
        w.move(_key(block, "grad"), block, 10 * MB, "nvme", "host", t(start), t(start + 20))
        w.move(_key(block, "exp_avg"), block, 30 * MB, "nvme", "host", t(start), t(start + 60))
    w.stall("b0", t(300), t(360), "nvme->host")
    w.compute("b0", t(360), t(370))
    w.stall("b1", t(370), t(420), "nvme->host")
    w.compute("b1", t(420), t(430))
    w.move(_key("b0", "exp_avg"), "b0", 30 * MB, "host", "nvme", t(380), t(440))
    w.move(_key("b1", "exp_avg"), "b1", 30 * MB, "host", "nvme", t(440), t(500))
    w.end_step(0, t(step_ms))
    w.close()


def test_each_phase_splits_into_compute_stall_serial_io_and_other(tmp_path: Path) -> None:
    write_clipped_step(tmp_path)
    m = breakdown(load_traces([tmp_path])).mean
    opt = m.phase("optimizer")
    assert opt.wall_ns == 200 * MS and opt.compute_ns == 20 * MS and opt.stall_ns == {DISK_READ: 110 * MS}
    assert opt.serial_io_ns == 70 * MS and opt.other_ns == 0  # [430, 500): only the last write in flight
    assert opt.serial_io_by_pair == {"host->nvme": 70 * MS}
    assert (opt.nvme("read"), opt.nvme("read", "grad"), opt.nvme("write")) == (80 * MB, 20 * MB, 60 * MB)
    assert opt.disk_busy_ns == 200 * MS and opt.read_busy_ns == 120 * MS and opt.write_busy_ns == 120 * MS
    bwd = m.phase("backward")
    assert (bwd.compute_ns, bwd.serial_io_ns) == (200 * MS, 0)
    assert (bwd.nvme("write", "grad"), bwd.disk_busy_ns) == (20 * MB, 20 * MS)
    assert m.wall_ns == 500 * MS


def test_optimizer_overlap_prediction_by_hand(tmp_path: Path) -> None:
    write_clipped_step(tmp_path)
    b = breakdown(load_traces([tmp_path]))
    p = optimizer_overlap(b, window=2, cuda=False)
    # the optimizer's disk time without the gradient reads: 200 ms x 120 / 140 MB = 171.4 ms; backward's own
    # disk time was all gradient writes: 0. Its compute path: 200 ms + 20 ms of Adam on a CPU-only run.
    # Backward = max(220, 0 + 171.4) = 220 ms; after it one of two shards (window 2 // 2): 100 ms.
    assert p.predicted_step_s == pytest.approx((100 + 220 + 100) / 1e3)
    assert p.saving_s == pytest.approx(0.080)
    assert "1 of 2 shards after it: 0.100 s" in p.how


def test_optimizer_overlap_on_cuda_overlaps_the_arithmetic_with_backward(tmp_path: Path) -> None:
    write_clipped_step(tmp_path, device="cuda")
    p = optimizer_overlap(breakdown(load_traces([tmp_path])), window=2, cuda=True)
    assert p.predicted_step_s == pytest.approx((100 + 200 + 100) / 1e3)


def test_removed_stalls_never_make_a_phase_shorter_than_its_disk_time(tmp_path: Path) -> None:
    write_clipped_step(tmp_path, forward_stall=True)
    b = breakdown(load_traces([tmp_path]))
    # forward: 100 ms with a 40 ms stall, but its read keeps the disk busy for 40 ms of it (from 0 to 40)
    p = stalls_removed(b, "forward", DISK_READ, "prefetch more")
    assert p.saving_s == pytest.approx(0.040)
    fwd = b.mean.phase("forward")
    fwd.disk_busy_ns = 70 * MS  # a slower disk: the read would still take 70 ms of the phase
    assert stalls_removed(b, "forward", DISK_READ, "prefetch more").saving_s == pytest.approx(0.030)


def test_a_prediction_is_checked_against_a_run_with_the_change(tmp_path: Path) -> None:
    write_clipped_step(tmp_path / "before")
    p = optimizer_overlap(breakdown(load_traces([tmp_path / "before"])), window=2, cuda=False)
    write_clipped_step(tmp_path / "after", step_ms=430)  # a run whose steps took 430 ms
    c = check(p, load_traces([tmp_path / "after"]))
    assert c.measured_step_s == pytest.approx(0.430) and c.measured_saving_s == pytest.approx(0.070)
    assert c.saving_error == pytest.approx((0.080 - 0.070) / 0.070)
    assert "predicted saving off by +14%" in str(c)
