"""TraceWriter: the records it writes, its step window, its durability and its thread safety."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from infinity.config import load_config
from infinity.profiler import TraceWriter, open_trace_writer, settings_from_config
from infinity.profiler.analysis import bytes_by_pair, validate
from infinity.profiler.encoding import seal_state
from infinity.profiler.format import FIELDS, VERSION
from infinity.profiler.traces import load_traces

REPO = Path(__file__).resolve().parent.parent


def _lines(path: str | Path) -> list[dict]:
    """The records of the trace at `path`, each line's checksum checked and left out."""
    lines = Path(path).read_text().splitlines()
    assert all(seal_state(line) for line in lines)
    return [{k: v for k, v in json.loads(line).items() if k != "crc32"} for line in lines]


def test_meta_is_the_first_line_and_is_on_disk_at_once(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path, 3, 4, {"aio": {"queue_depth": 8}}, raw_disk={"read_gbps": 2.0, "write_gbps": 1.0})
    meta = _lines(tmp_path / "trace_rank3.jsonl")[0]
    assert meta["type"] == "meta" and meta["version"] == VERSION and (meta["rank"], meta["world_size"]) == (3, 4)
    assert meta["settings"]["aio"]["queue_depth"] == 8 and meta["raw_disk"]["read_gbps"] == 2.0
    assert isinstance(meta["t0_ns"], int) and isinstance(meta["t0_unix_ns"], int)
    w.close()


def test_events_outside_the_step_window_are_dropped(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path, 0, 1, {}, start_step=2, end_step=3)
    for step in range(6):
        w.begin_step(step)
        assert w.active == (2 <= step <= 3)
        w.move(f"k{step}", "b", 10, "nvme", "host", 1, 2)
        w.end_step(step)
        w.compute("between", 3, 4)  # after step 3 ended: outside the window
    w.close()
    moves = [r for r in _lines(w.path) if r["type"] == "move"]
    assert [(r["key"], r["step"]) for r in moves] == [("k2", 2), ("k3", 3)]
    assert [r["block"] for r in _lines(w.path) if r["type"] == "compute"] == ["between"]  # between 2 and 3


def test_phases_and_steps_are_written_as_spans(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path, 0, 1, {})
    w.begin_step(0, 100)
    w.set_phase("backward", 150)
    w.set_phase("backward", 160)  # no change: no record
    w.set_phase("optimizer", 190)
    w.end_step(0, 200)
    w.close()
    spans = [(r["type"], r.get("phase"), r["start_ns"], r["end_ns"]) for r in _lines(w.path)[1:]]
    assert spans == [("phase", "forward", 100, 150), ("phase", "backward", 150, 190),
                     ("phase", "optimizer", 190, 200), ("step", None, 100, 200)]


def test_each_record_has_the_fields_of_the_format(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path, 0, 2, {}, sample_rss=True)  # two ranks: collectives are recorded
    w.live("host", 7)
    w.begin_step(0)
    w.move(("blk", "param"), "blk", 8, "nvme", "host", 1, 2)
    w.stall("blk", 2, 3, "nvme->host")
    w.collective("all-gather", "blk", 16, 3, 4)
    w.compute("blk", 4, 5)
    w.prefetch("blk", 1)
    w.use("blk", True, 4)
    w.pool_exhausted("param", 9, 5)
    w.live("host", 15, 6)
    w.held("host", "staging", 15, 6)
    w.queue("nvme-read", 2, 6)
    w.peak("host", 15, 7)
    w.end_step(0)
    w.close()
    records = _lines(w.path)
    assert {r["type"] for r in records} == set(FIELDS)
    for r in records:
        assert set(FIELDS[r["type"]]) <= set(r), r
    assert records[1] == {"type": "live", "tier": "host", "bytes": 7, "t_ns": records[1]["t_ns"]}  # carried in
    assert [r["type"] for r in records].count("rss") == 2  # the step's start and end
    assert validate(load_traces([tmp_path])) == []


def test_strings_are_escaped_and_a_bad_field_drops_only_its_record(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path, 0, 1, {})
    w.begin_step(0)
    w.move('odd "key"\n', "blk\\1", 8, "nvme", "host", 1, 2)
    with pytest.warns(RuntimeWarning, match="dropped a compute record"):
        w.compute("blk", None, 5)  # type: ignore[arg-type]
        w.flush()
    w.compute("blk", 4, 5)
    w.close()
    records = _lines(w.path)
    assert records[1]["key"] == 'odd "key"\n' and records[1]["block"] == "blk\\1"
    assert [r["type"] for r in records[1:]] == ["move", "compute"] and w.bad_records == 1


def test_the_writer_is_a_storage_recorder(tmp_path: Path) -> None:
    recorder = pytest.importorskip("infinity.storage.recorder")
    w = TraceWriter(tmp_path, 0, 1, {})
    w.begin_step(0)
    w.record(recorder.MoveEvent(("h.3", "param"), 4096, "nvme", "host", 10, 20, 0))
    w.record(recorder.MoveEvent("flat", 512, "host", "device", 20, 25, 0))
    w.end_step(0)
    w.close()
    moves = [r for r in _lines(w.path) if r["type"] == "move"]
    assert [(m["key"], m["block"], m["bytes"], m["src"], m["dst"]) for m in moves] == [
        ("('h.3', 'param')", "h.3", 4096, "nvme", "host"), ("flat", "flat", 512, "host", "device")]


def test_records_from_many_threads_are_all_kept_whole(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path, 0, 1, {}, flush_every=7)
    w.begin_step(0)

    def record(thread: int) -> None:
        for i in range(500):
            w.move(f"{thread}/{i}", "b", thread + 1, "nvme", "host", i, i + 1)

    threads = [threading.Thread(target=record, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.end_step(0)
    w.close()
    traces = load_traces([tmp_path])
    assert len(traces[0].of("move")) == 4000
    assert bytes_by_pair(traces) == {"nvme->host": 500 * sum(range(1, 9))}


def test_a_killed_process_leaves_all_but_the_last_unflushed_records(tmp_path: Path) -> None:
    script = f"""
import os, sys
sys.path.insert(0, {str(REPO)!r})
from infinity.profiler import TraceWriter
w = TraceWriter({str(tmp_path)!r}, 0, 1, {{}}, flush_every=16)
for step in range(3):
    w.begin_step(step)
    for i in range(40):
        w.move(f"k{{i}}", "b", 100, "nvme", "host", i, i + 1)
    if step < 2:
        w.end_step(step)
os._exit(9)  # no close, no atexit: like a crash
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 9, done.stderr
    trace = load_traces([tmp_path])[0]
    assert [r["step"] for r in trace.of("step")] == [0, 1]
    in_step_2 = [r for r in trace.of("move") if r["step"] == 2]
    assert 40 - 16 < len(in_step_2) <= 40  # at most flush_every - 1 records lost


def test_close_is_idempotent_and_later_events_are_dropped(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path, 0, 1, {})
    w.begin_step(0)
    w.close()
    w.close()
    w.move("k", "b", 1, "nvme", "host", 1, 2)
    w.begin_step(1)
    assert not w.active and len(_lines(w.path)) == 1


def test_window_must_be_ordered(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="end_step 1 is before start_step 5"):
        TraceWriter(tmp_path, 0, 1, {}, start_step=5, end_step=1)


def test_disabled_profiler_is_none_and_enabled_one_reads_the_config(tmp_path: Path) -> None:
    cfg = load_config({"profiler": {"enabled": False, "path": str(tmp_path / "t"), "start_step": 1, "end_step": 2},
                       "aio": {"queue_depth": 4}, "zero_optimization": {"offload_param": {"buffer_count": 2}}})
    assert open_trace_writer(cfg, 0, 1) is None
    w = open_trace_writer(cfg, 1, 2, enabled=True, raw_disk={"read_gbps": 3.0, "write_gbps": 2.0})
    assert w is not None and w.step_window == (1, 2)
    w.close()
    meta = _lines(tmp_path / "t" / "trace_rank1.jsonl")[0]
    assert meta["settings"] == settings_from_config(cfg)
    assert meta["settings"]["aio"]["queue_depth"] == 4 and meta["settings"]["offload_param"]["buffer_count"] == 2


def test_format_doc_lists_every_record_type() -> None:
    doc = (REPO / "infinity" / "profiler" / "FORMAT.md").read_text()
    for kind, fields in FIELDS.items():
        assert f"| `{kind}` |" in doc
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{kind}` |"))
        assert all(f"`{name}`" in row for name in fields), kind


def test_settings_come_from_attributes_only() -> None:
    z = SimpleNamespace(stage3_prefetch_bucket_size=1, stage3_max_live_parameters=2,
                        offload_param=SimpleNamespace(device="nvme", buffer_count=3, buffer_size=4, max_in_cpu=8),
                        offload_optimizer=SimpleNamespace(device="cpu", buffer_count=5))
    aio = SimpleNamespace(block_size=4096, queue_depth=6, intra_op_parallelism=7)
    s = settings_from_config(SimpleNamespace(zero_optimization=z, aio=aio))
    assert s["aio"] == {"block_size": 4096, "queue_depth": 6, "intra_op_parallelism": 7}
    assert s["offload_optimizer"] == {"device": "cpu", "buffer_count": 5}  # no keys that change nothing


def test_the_meta_line_carries_the_resolved_config_and_the_compute_device(tmp_path: Path) -> None:
    cfg = load_config({"gradient_clipping": 1.0, "bf16": {"enabled": True},
                       "profiler": {"path": str(tmp_path / "t")}})  # fmt: skip
    w = open_trace_writer(cfg, 0, 1, enabled=True)
    w.close()
    meta = _lines(tmp_path / "t" / "trace_rank0.jsonl")[0]
    assert meta["config"] == cfg.to_dict() and meta["config"]["gradient_clipping"] == 1.0
    assert meta["device"] in ("cpu", "cuda") and meta["raw_disk"] is None  # no NVMe offload: nothing to probe


def test_rss_is_sampled_at_phase_changes_and_sees_memory_the_process_takes(tmp_path: Path) -> None:
    import mmap

    w = TraceWriter(tmp_path, 0, 1, {}, sample_rss=True)
    w.begin_step(0)
    held = mmap.mmap(-1, 64 << 20)  # fresh anonymous pages, whatever malloc keeps
    for offset in range(0, len(held), 4096):
        held[offset] = 1  # touched: now resident
    w.set_phase("backward")
    w.end_step(0)
    w.close()
    held.close()
    rss = [r["bytes"] for r in _lines(w.path) if r["type"] == "rss"]
    assert len(rss) == 3 and rss[1] - rss[0] >= 60 << 20


def test_a_wait_for_memory_is_a_pool_exhaustion_and_on_the_training_thread_a_stall(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path, 0, 1, {})
    w.begin_step(0, 0)
    w.memory_wait("host", "param", ("blocks.3#0", "param"), 10, 40)
    w.open_span("stall")  # inside a gather's wait: the gather's stall covers it
    w.memory_wait("host", "optimizer", ("blocks.4#0", "exp_avg"), 50, 60)
    w.close_span("stall")
    other = threading.Thread(target=w.memory_wait, args=("device", "param", ("blocks.5#0", "param"), 70, 90))
    other.start()
    other.join()
    w.end_step(0, 100)
    w.close()
    records = _lines(w.path)
    pools = [(r["pool"], r["wait_ns"]) for r in records if r["type"] == "pool"]
    assert pools == [("param", 30), ("optimizer", 10), ("device param", 20)]
    stalls = [(r["block"], r["start_ns"], r["end_ns"], r["waited_on"]) for r in records if r["type"] == "stall"]
    assert stalls == [("blocks.3", 10, 40, "pool")]  # not the covered one, nor another thread's
