"""The report's numbers on a hand-built trace whose answers are computed here by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trace_edits import reseal

from infinity.profiler import TraceWriter
from infinity.profiler.analysis import bytes_by_pair, drop_malformed, summarize, union_ns, validate
from infinity.profiler.encoding import seal_object
from infinity.profiler.report import build_report
from infinity.profiler.traces import load_traces

pytestmark = pytest.mark.unit

MS = 1_000_000
B = 10**12  # an arbitrary origin: only differences matter
SETTINGS = {"stage3_prefetch_bucket_size": 50_000_000, "aio": {"block_size": 1 << 20, "queue_depth": 8,
                                                              "intra_op_parallelism": 1}}


def write_known_step(path: Path, rank: int = 0, scale: int = 1, world_size: int = 2) -> Path:
    """One step of 1000 ms of a rank of a two-rank run: forward [0, 400), backward [400, 800), optimizer
    [800, 1000); bytes x `scale`."""
    w = TraceWriter(path, rank, world_size, SETTINGS, raw_disk={"read_gbps": 2.0, "write_gbps": 1.0})
    t = lambda ms: B + int(ms * MS)  # noqa: E731
    w.live("host", 50_000_000, t(-5))  # before the window: carried into the step's start
    w.live("device", 0, t(-5))
    w.move("dropped", "b0", 10**9, "nvme", "host", t(-5), t(-1))  # outside the window: dropped
    w.begin_step(0, t(0))
    w.use("b0", False, t(0))
    w.stall("b0", t(0), t(40), "nvme->host")
    w.move("k0", "b0", 100_000_000 * scale, "nvme", "host", t(0), t(100))
    w.move("k1", "b1", 100_000_000 * scale, "nvme", "host", t(50), t(150))  # overlaps k0: busy 150 ms
    w.move("k0", "b0", 50_000_000 * scale, "host", "device", t(100), t(125))
    w.prefetch("b1", t(10))
    w.compute("b0", t(40), t(140))
    w.live("device", 50_000_000, t(125))
    w.collective("all-gather", "b1", 50_000_000, t(130), t(140))
    w.use("b1", True, t(140))
    w.compute("b1", t(140), t(240))
    w.live("host", 250_000_000, t(150))
    w.use("b2", True, t(240))
    w.compute("b2", t(240), t(300))
    w.live("host", 150_000_000, t(300))
    w.use("b3", True, t(300))
    w.compute("b3", t(300), t(400))
    w.set_phase("backward", t(400))
    w.use("b3", False, t(400))
    w.stall("b3", t(400), t(420), "all-gather")
    w.compute("b3", t(420), t(600))
    w.live("host", 400_000_000, t(500))
    w.use("b2", True, t(600))
    w.compute("b2", t(600), t(800))
    w.move("g2", "b2", 25_000_000 * scale, "device", "host", t(600), t(650))
    w.collective("reduce-scatter", "b3", 25_000_000, t(600), t(610))
    w.live("host", 100_000_000, t(700))
    w.set_phase("optimizer", t(800))
    w.move("m0", "b0", 100_000_000 * scale, "host", "nvme", t(800), t(900))
    w.pool_exhausted("optimizer", 5 * MS, t(850))
    w.live("host", 0, t(950))
    w.end_step(0, t(1000))
    w.close()
    return Path(w.path)


@pytest.fixture
def one_rank(tmp_path: Path):
    write_known_step(tmp_path)
    return load_traces([tmp_path])


def test_union_of_spans_counts_overlap_once() -> None:
    assert union_ns([(0, 10), (5, 15), (20, 30), (30, 31)]) == 26
    assert union_ns([]) == 0


def test_bytes_per_tier_pair_are_the_bytes_written_inside_the_window(one_rank) -> None:
    assert bytes_by_pair(one_rank) == {"nvme->host": 200_000_000, "host->device": 50_000_000,
                                       "device->host": 25_000_000, "host->nvme": 100_000_000}


def test_busy_and_wall_bandwidth_per_phase(one_rank) -> None:
    s = summarize(one_rank)
    fwd = s.steps[0].phases["forward"]
    assert fwd.wall_ns == 400 * MS
    reads = fwd.moves["nvme->host"]
    assert (reads.bytes, reads.count, reads.busy_ns) == (200_000_000, 2, 150 * MS)
    assert reads.gbps_busy == pytest.approx(200e6 / 0.150 / 1e9)
    assert reads.gbps_wall == pytest.approx(200e6 / 0.400 / 1e9)
    assert fwd.moves["host->device"].gbps_busy == pytest.approx(2.0)
    assert fwd.collectives["all-gather"].gbps_busy == pytest.approx(5.0)
    opt = s.steps[0].phases["optimizer"]
    assert opt.moves["host->nvme"].gbps_busy == pytest.approx(1.0)
    assert opt.moves["host->nvme"].gbps_wall == pytest.approx(0.5)


def test_stall_share_of_step_and_phase(one_rank) -> None:
    s = summarize(one_rank)
    step = s.steps[0]
    assert step.total.wall_ns == 1000 * MS and step.total.stall_ns == 60 * MS
    assert step.total.stall_share == pytest.approx(0.06)
    assert step.phases["forward"].stall_share == pytest.approx(0.10)
    assert step.phases["backward"].stall_by_wait == {"all-gather": 20 * MS}
    assert step.phases["optimizer"].stall_ns == 0


def test_prefetch_hit_rate(one_rank) -> None:
    s = summarize(one_rank)
    assert (s.steps[0].phases["forward"].hits, s.steps[0].phases["forward"].uses) == (3, 4)
    assert s.steps[0].phases["backward"].hit_rate == pytest.approx(0.5)
    assert s.total.hit_rate == pytest.approx(4 / 6)


def test_peak_live_bytes_per_phase_include_the_level_carried_in(one_rank) -> None:
    phases = summarize(one_rank).steps[0].phases
    assert phases["forward"].peak_live == {"host": 250_000_000, "device": 50_000_000}
    assert phases["backward"].peak_live["host"] == 400_000_000
    assert phases["optimizer"].peak_live["host"] == 100_000_000  # level at the phase's start
    assert summarize(one_rank).total.peak_live["host"] == 400_000_000


def test_slowest_and_most_stalled_blocks(one_rank) -> None:
    s = summarize(one_rank, top=2)
    assert [(b.block, b.phase, b.mean_ns) for b in s.slowest_compute] == [("b2", "backward", 200 * MS),
                                                                           ("b3", "backward", 180 * MS)]
    assert [(b.block, b.total_ns, b.waited_on) for b in s.most_stalled] == [
        ("b0", 40 * MS, {"nvme->host": 40 * MS}), ("b3", 20 * MS, {"all-gather": 20 * MS})]
    assert s.pools == {"optimizer": (1, 5 * MS)}


def test_two_ranks_sum_bytes_and_time_and_take_the_highest_peak(tmp_path: Path) -> None:
    write_known_step(tmp_path, rank=0, world_size=2)
    write_known_step(tmp_path, rank=1, scale=2, world_size=2)
    s = summarize(load_traces([tmp_path]))
    reads = s.steps[0].phases["forward"].moves["nvme->host"]
    assert (reads.bytes, reads.busy_ns) == (600_000_000, 300 * MS)
    assert reads.gbps_busy == pytest.approx(2.0)
    assert s.total.ranks == 2 and s.total.stall_share == pytest.approx(0.06)
    assert s.ranks == [0, 1] and s.world_size == 2


def test_the_printed_report_carries_the_numbers_and_says_which_rate_is_which(tmp_path: Path) -> None:
    write_known_step(tmp_path)
    text = build_report([tmp_path], plots=False).text
    assert "1.33 GB/s busy" in text and "0.50 GB/s wall" in text
    assert "union of move spans" in text
    assert "3/4 (75%)" in text and "host 0.250 GB" in text
    assert "'optimizer' exhausted 1 times" in text


def test_the_printed_step_tables_give_bytes_and_ops_per_rank_as_they_give_times(tmp_path: Path) -> None:
    # rank 0 reads 200 MB in forward in 2 ops, rank 1 400 MB in 2 ops: the mean rank, 300 MB in 2 ops
    write_known_step(tmp_path, rank=0, world_size=2)
    write_known_step(tmp_path, rank=1, scale=2, world_size=2)
    text = build_report([tmp_path], plots=False).text
    step = text[text.index("\nstep 0\n") :]
    forward_reads = next(line for line in step.splitlines() if line.strip().startswith("nvme->host"))
    assert forward_reads.split()[1:5] == ["0.300", "GB", "in", "2"]
    assert "bytes, op counts and rates are per rank" in text


def test_well_formed_trace_has_no_problems(one_rank) -> None:
    assert validate(one_rank) == []


def test_validator_names_malformed_records_and_overlapping_spans(tmp_path: Path) -> None:
    path = write_known_step(tmp_path)
    bad = [
        {"type": "move", "key": "x", "block": "b", "bytes": 1, "src": "nvme", "dst": "disk", "start_ns": 1,
         "end_ns": 2, "step": 0, "phase": "forward"},
        {"type": "compute", "block": "b", "start_ns": 5, "end_ns": 4, "step": 0, "phase": "forward"},
        {"type": "stall", "block": "b", "start_ns": 1, "end_ns": 2, "waited_on": "nvme->host", "step": 0},
        {"type": "compute", "block": "b9", "start_ns": B + 50 * MS, "end_ns": B + 60 * MS, "step": 0,
         "phase": "forward"},
    ]
    with open(path, "a") as f:
        f.writelines(seal_object(r) for r in bad)
    traces = load_traces([path])
    problems = validate(traces)
    assert any("bad tiers" in p for p in problems)
    assert any("ends before it starts" in p for p in problems)
    assert any("phase=None" in p for p in problems)
    assert any("compute spans overlap" in p for p in problems)
    assert drop_malformed(traces) == 3


def test_a_cut_last_line_is_skipped_and_the_rest_is_read(tmp_path: Path) -> None:
    path = write_known_step(tmp_path)
    text = path.read_text()
    path.write_text(text + '{"type":"move","key":"k9","blo')
    trace = load_traces([path])[0]
    assert trace.truncated and bytes_by_pair([trace])["nvme->host"] == 200_000_000
    assert "the run crashed" in build_report([path], plots=False).text


def test_a_bad_line_in_the_middle_is_an_error_naming_the_line(tmp_path: Path) -> None:
    path = write_known_step(tmp_path)
    lines = path.read_text().splitlines()
    lines[3] = lines[3][:10]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"trace_rank0.jsonl:4: the line has lost its checksum"):
        load_traces([path])


def test_a_byte_that_is_not_utf8_is_an_error_naming_the_file_line_and_offset(tmp_path: Path) -> None:
    path = write_known_step(tmp_path)
    data = path.read_bytes()
    third = data.index(b"\n", data.index(b"\n") + 1) + 1  # the third line's first byte
    path.write_bytes(data[: third + 5] + b"\xff" + data[third + 6 :])
    with pytest.raises(ValueError, match=rf"trace_rank0.jsonl:3: byte 0xff at offset {third + 5} is not UTF-8"):
        load_traces([path])


def test_a_last_line_cut_inside_a_character_is_skipped_as_a_cut_line(tmp_path: Path) -> None:
    path = write_known_step(tmp_path)
    path.write_bytes(path.read_bytes() + '{"type":"move","key":"\u00e9'.encode()[:-1])  # half of a 2-byte character
    trace = load_traces([path])[0]
    assert trace.truncated and bytes_by_pair([trace])["nvme->host"] == 200_000_000


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("settings", "x", """'settings' is "x", needs a JSON object"""),
        ("settings", {"offload_param": "nvme"}, """'settings.offload_param' is "nvme", needs a JSON object"""),
        ("rank", "0", """'rank' is "0", needs an integer"""),
        ("t0_ns", None, "has no 't0_ns'"),
    ],
)
def test_a_meta_line_the_reader_cannot_use_is_an_error_naming_the_file_and_field(
    tmp_path: Path, field: str, value, named: str
) -> None:
    path = write_known_step(tmp_path)
    meta, rest = path.read_text().split("\n", 1)
    path.write_text(reseal(json.dumps({**json.loads(meta), field: value}) + "\n" + rest))
    with pytest.raises(ValueError, match="trace_rank0.jsonl:1: the meta line") as info:
        load_traces([path])
    assert named in str(info.value)


def test_a_step_cut_by_a_crash_is_reported_from_its_events(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path, 0, 1, SETTINGS)
    w.begin_step(3, B)
    w.move("k", "b", 1000, "nvme", "host", B + 10, B + 20)
    w.stall("b", B + 5, B + 25, "nvme->host")
    w.flush()  # then the process dies: no end_step, no close
    s = summarize(load_traces([tmp_path]))
    step = s.steps[0]
    assert step.step == 3 and not step.total.complete
    assert step.total.wall_ns == 20 and step.total.stall_ns == 20
    assert "(incomplete)" in build_report([tmp_path], plots=False).text
    w.close()
