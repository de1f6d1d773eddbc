"""The report's files: Perfetto JSON that the trace-event importer accepts, PNGs that load, the CLIs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from test_profiler_report import write_known_step
from trace_edits import reseal

from infinity.profiler.cli import main
from infinity.profiler.perfetto import _lanes, chrome_trace
from infinity.profiler.plots import bandwidth_bins
from infinity.profiler.synthetic import SCENARIOS, write_scenario
from infinity.profiler.traces import load_traces

pytest_plugins = ["storage_fixtures"]  # a real read-only directory: a read-only bind mount

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def two_ranks(tmp_path: Path) -> Path:
    write_known_step(tmp_path, rank=0, world_size=2)
    write_known_step(tmp_path, rank=1, scale=2, world_size=2)
    return tmp_path


def test_overlapping_spans_get_separate_lanes() -> None:
    assert _lanes([(0, 10), (5, 15), (10, 20), (12, 13), (20, 30)]) == [0, 1, 0, 2, 0]


def test_perfetto_json_has_a_process_per_rank_and_the_named_tracks(two_ranks: Path) -> None:
    trace = json.loads(json.dumps(chrome_trace(load_traces([two_ranks]))))
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {0: "rank 0", 1: "rank 1"}
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    for name in ("steps", "phases", "compute", "stalls", "collectives", "nvme->host", "nvme->host #2",
                 "host->device", "device->host", "host->nvme", "pools", "prefetch/use"):
        assert (0, name) in threads and (1, name) in threads, name
    counters = {(e["pid"], e["name"]) for e in events if e["ph"] == "C"}
    assert (0, "live host bytes") in counters and (1, "live device bytes") in counters
    moves = [e for e in events if e["ph"] == "X" and e["cat"] == "move" and e["pid"] == 1]
    assert sum(e["args"]["bytes"] for e in moves) == 2 * (200_000_000 + 50_000_000 + 25_000_000 + 100_000_000)


def test_perfetto_phases_carry_their_breakdown_and_the_serial_io_and_bandwidth_tracks_exist(tmp_path: Path) -> None:
    write_scenario(str(tmp_path), SCENARIOS["clipped"])
    events = chrome_trace(load_traces([tmp_path]))["traceEvents"]
    phases = [e for e in events if e["ph"] == "X" and e["cat"] == "phase" and e["name"] == "optimizer"]
    assert phases and all(e["args"]["stall ms (whole phase)"] > 0 for e in phases)
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"phases", "stalls", "serial I/O"} <= threads
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert {"NVMe read GB/s", "NVMe write GB/s", "held host optimizer bytes", "store peak host bytes"} <= counters
    stalls = {e["name"].split(":")[0] for e in events if e["ph"] == "X" and e["cat"] == "stall"}
    assert stalls == {"stall on disk read"}


def test_perfetto_slices_on_one_track_never_overlap_and_are_well_formed(two_ranks: Path) -> None:
    events = chrome_trace(load_traces([two_ranks]))["traceEvents"]
    by_track = defaultdict(list)
    for e in events:
        assert e["ph"] in ("M", "X", "C", "i") and isinstance(e["pid"], int)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0 and isinstance(e["name"], str)
            by_track[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_track.values():
        spans.sort()
        assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:], strict=False))
    compute = sorted(e["ts"] for e in events if e["ph"] == "X" and e["cat"] == "compute" and e["pid"] == 0)
    assert compute[1] - compute[0] == pytest.approx(100_000)  # microseconds: b1 starts 100 ms after b0


def test_bandwidth_bins_conserve_bytes(two_ranks: Path) -> None:
    width_s, series = bandwidth_bins(load_traces([two_ranks]), bins=50)
    moved = {pair: sum(gbps * width_s * 1e9 for gbps in values) for pair, values in series.items()}
    assert moved["nvme->host"] == pytest.approx(600_000_000)
    assert moved["host->nvme"] == pytest.approx(300_000_000)


def test_cli_prints_the_report_and_writes_perfetto_summary_and_loadable_pngs(two_ranks: Path, capsys) -> None:
    image = pytest.importorskip("matplotlib.image")
    out = two_ranks / "out"
    assert main([str(two_ranks / "trace_rank0.jsonl"), str(two_ranks / "trace_rank1.jsonl"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 rank(s)" in text and "diagnosis:" in text and "trace.perfetto.json" in text
    assert json.loads((out / "trace.perfetto.json").read_text())["traceEvents"]
    assert json.loads((out / "summary.json").read_text())["summary"]["total"]["stall_share"] == pytest.approx(0.06)
    written = [line.strip() for line in text.split("written:")[1].splitlines() if line.strip()]
    pngs = [Path(f).name for f in written if f.endswith(".png")]
    assert pngs == ["steps.png", "timeline.png", "blocks.png", "live_bytes.png"]  # the step picture first
    for name in pngs:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        pixels = image.imread(out / name)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100


def test_missing_matplotlib_is_a_note_not_a_crash(two_ranks: Path, monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    from infinity.profiler.report import build_report

    report = build_report([two_ranks], two_ranks / "out")
    assert "matplotlib is not installed" in report.text
    assert not list((two_ranks / "out").glob("*.png")) and (two_ranks / "out" / "trace.perfetto.json").exists()


def test_cli_names_a_missing_trace_and_exits_2(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path / "nope.jsonl")]) == 2
    assert "no such trace file" in capsys.readouterr().err


def test_tool_script_runs_from_a_checkout(tmp_path: Path) -> None:
    write_scenario(str(tmp_path), SCENARIOS["tuned"])
    done = subprocess.run([sys.executable, str(REPO / "tools" / "swap_profile.py"), str(tmp_path), "--no-plots",
                           "--out", str(tmp_path / "r")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no change needed" in done.stdout and (tmp_path / "r" / "trace.perfetto.json").exists()


def test_cli_checks_the_top_prediction_against_a_run_with_the_change_made(tmp_path: Path, capsys) -> None:
    write_scenario(str(tmp_path / "clipped"), SCENARIOS["clipped"])
    write_scenario(str(tmp_path / "overlapped"), SCENARIOS["tuned"])  # the same run, stepping during backward
    args = [str(tmp_path / "clipped"), "--no-plots", "--out", str(tmp_path / "r")]
    args += ["--against", str(tmp_path / "overlapped")]
    assert main(args) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("what-if check, the optimizer step overlapped with backward: predicted step ")
    assert "measured" in last and "predicted saving off by" in last


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def _not_utf8(path: Path) -> Path:
    path.write_bytes(b'{"type": "meta", "rank": 0, "t0_ns": 1, "settings": {}, "note": "\xff"}\n')
    return path


@pytest.mark.parametrize("bad", ["empty", "missing", "not_utf8.jsonl"])
def test_against_traces_that_cannot_be_read_are_named_as_the_main_ones_are(tmp_path: Path, capsys, bad) -> None:
    write_scenario(str(tmp_path / "clipped"), SCENARIOS["clipped"])  # a report with a prediction to check
    (tmp_path / "empty").mkdir()
    _not_utf8(tmp_path / "not_utf8.jsonl")
    assert main([str(tmp_path / bad), "--no-plots"]) == 2
    as_main = _one_error_line(capsys).removeprefix("infinity profile: ")
    args = [str(tmp_path / "clipped"), "--no-plots", "--out", str(tmp_path / "r"), "--against", str(tmp_path / bad)]
    assert main(args) == 2
    assert _one_error_line(capsys) == f"infinity profile: --against: {as_main}"
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_a_trace_that_is_not_utf8_is_named_with_its_line_and_offset(tmp_path: Path, capsys) -> None:
    path = _not_utf8(tmp_path / "trace_rank0.jsonl")
    assert main([str(path), "--no-plots"]) == 2
    assert _one_error_line(capsys) == (
        f"infinity profile: {path}:1: byte 0xff at offset {path.read_bytes().index(0xFF)} is not UTF-8; a trace is "
        "UTF-8 JSON lines written by the infinity profiler"
    )


def test_a_meta_line_whose_settings_is_not_an_object_is_named(tmp_path: Path, capsys) -> None:
    path = write_known_step(tmp_path)
    meta, rest = path.read_text().split("\n", 1)
    path.write_text(reseal(json.dumps({**json.loads(meta), "settings": "x"}) + "\n" + rest))
    assert main([str(path), "--no-plots"]) == 2
    line = _one_error_line(capsys)
    assert f"{path}:1: the meta line's 'settings' is \"x\", needs a JSON object" in line


def test_an_out_that_is_a_file_is_named_and_left_alone(two_ranks: Path, capsys) -> None:
    (two_ranks / "summary.txt").write_text("mine")
    assert main([str(two_ranks), "--no-plots", "--out", str(two_ranks / "summary.txt")]) == 3
    line = _one_error_line(capsys)
    assert f"--out '{two_ranks / 'summary.txt'}' is a file, not a folder; give a folder" in line
    assert (two_ranks / "summary.txt").read_text() == "mine"


def test_a_read_only_out_is_named_with_what_to_do(two_ranks: Path, capsys, read_only_dir: Path) -> None:
    assert main([str(two_ranks), "--no-plots", "--out", str(read_only_dir / "report")]) == 3
    line = _one_error_line(capsys)
    assert f"--out '{read_only_dir / 'report'}'" in line and "read-only filesystem" in line
    assert "give --out a writable folder" in line

