"""Each configuration in its own processes: one for plain PyTorch or one rank, torchrun for several.

A configuration's peak RSS is then its own, and a crash or a refusal (an engine that does not
support a stage yet) costs one row, not the run. `run_configuration` returns the ranks' records
merged into one (`merge_ranks`), or {"error": ...}; `merge_rounds` pools the rounds of one
configuration.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any

from benchlib.trainers import CONFIGS

TOOLS_DIR = Path(__file__).resolve().parent.parent
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_running: list[subprocess.Popen] = []


def _process_tree(root: int) -> list[int]:
    """`root` and every process descended from it (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])  # the name in parentheses may hold spaces
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def kill_tree(root: int) -> None:
    """SIGKILL `root` and its descendants: torchrun starts each worker in a session of its own, so killing
    its process group alone leaves them running. Stopped first, so that none is started or orphaned meanwhile."""
    stopped: set[int] = set()
    for _ in range(2):  # a second look catches a process started while the first list was stopped
        for pid in _process_tree(root):
            if pid not in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                stopped.add(pid)
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def kill_running() -> None:
    """Kill the configuration running now, all its processes (from a signal handler)."""
    for proc in _running:
        if proc.poll() is None:
            kill_tree(proc.pid)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(spec: dict[str, Any], ranks: int) -> tuple[list[str], dict[str, str]]:
    cfg = CONFIGS[spec["name"]]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    env.update(OMP_NUM_THREADS=str(spec["threads"]), PYTHONPATH=os.pathsep.join(
        [str(TOOLS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]))  # fmt: skip
    if cfg.framework == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    child = ["-m", "benchlib.train_child", "--spec", json.dumps(spec)]
    if cfg.distributed and ranks > 1:
        launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
                    f"--master-port={free_port()}"]  # fmt: skip
        return [sys.executable, *launcher, *child], env
    if cfg.framework in ("ddp", "fsdp2", "deepspeed"):  # one rank, but a process group all the same
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))  # fmt: skip
    return [sys.executable, *child], env


def run_configuration(spec: dict[str, Any], ranks: int, workdir: Path, timeout_s: float,
                      env_unset: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    """Run `spec["name"]` on `ranks` ranks (plain: one process) with its own record and NVMe folders in
    `workdir`, both removed afterwards; relays the children's progress lines. The merged record."""
    name = spec["name"]
    record_dir, nvme_dir = workdir / f"{name}.records", workdir / f"{name}.nvme"
    for folder in (record_dir, nvme_dir):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    ranks = ranks if CONFIGS[name].distributed else 1
    cmd, env = _command({**spec, "record_dir": str(record_dir), "nvme_path": str(nvme_dir)}, ranks)
    for key in env_unset:
        env.pop(key, None)
    tail: deque[str] = deque(maxlen=20)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    _running.append(proc)
    timed_out = threading.Event()

    def on_timeout() -> None:
        timed_out.set()
        kill_tree(proc.pid)

    timer = threading.Timer(timeout_s, on_timeout)
    timer.start()
    try:
        for line in proc.stdout:
            if line.startswith(f"[{name}]"):
                print(line, end="", flush=True)
            else:
                tail.append(line.rstrip())
        code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
        _running.remove(proc)
        records = [json.loads(p.read_text()) for p in sorted(record_dir.glob("rank*.json"))]
        shutil.rmtree(record_dir, ignore_errors=True)
        shutil.rmtree(nvme_dir, ignore_errors=True)
    if timed_out.is_set():
        return {"error": f"timed out after {timeout_s:g} s"}
    errors = [r for r in records if "error" in r]
    if errors:
        return {"error": f"rank {errors[0]['rank']}: {errors[0]['error']}", "traceback": errors[0]["traceback"]}
    if len(records) != ranks:
        return {"error": f"exit code {code}, {len(records)} of {ranks} rank records: " + "\n".join(tail)}
    merged = merge_ranks(sorted(records, key=lambda r: r["rank"]), spec)
    if code != 0:
        merged["exit_code_after_records"] = code  # every rank finished and wrote its record, then the exit failed
    return merged


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def merge_ranks(records: list[dict[str, Any]], spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration's record from its ranks' (ordered by rank).

    A step takes as long as its slowest rank; a step's loss is the mean of the ranks' losses (each
    over an equal slice of the global batch: the loss of the whole batch); memory is per rank.
    """
    warmup = spec["warmup"]
    per_step = list(zip(*(r["steps"] for r in records), strict=True))
    step_times = [max(s["step_s"] for s in ranks) for ranks in per_step]
    timed = step_times[warmup:] or step_times
    step_s = _median(timed)
    lead = records[0]["steps"][warmup:] or records[0]["steps"]
    out: dict[str, Any] = {
        "step_s": step_s,
        "tokens_per_s": spec["batch"] * spec["seq"] / step_s,
        "step_s_min": min(timed),
        "step_times_s": timed,
        "phases_s": {k: _median([s[k] for s in lead]) for k in ("forward_s", "backward_s", "optimizer_s")},
        "losses": [statistics.fmean(s["loss"] for s in ranks) for ranks in per_step],
        "ranks": len(records),
        "threads_per_rank": records[0]["threads"],
        "init_s": max(r["init_s"] for r in records),
        "model_params": records[0]["model_params"],
    }
    for key in ("cpu_s", "sys_s", "page_faults"):
        out[key] = [_median([s.get(key, 0) for s in r["steps"][warmup:] or r["steps"]]) for r in records]
    for key in ("rss_at_start_bytes", "rss_after_build_bytes", "rss_after_setup_bytes", "peak_rss_after_setup_bytes",
                "rss_after_steps_bytes", "peak_rss_bytes"):  # fmt: skip
        out[key] = [r[key] for r in records]
    out["max_peak_rss_bytes"] = max(out["peak_rss_bytes"])
    for key in ("malloc_live_at_start_bytes", "malloc_live_after_steps_bytes"):
        if all(r.get(key) is not None for r in records):
            out[key] = [r[key] for r in records]
    if "kept_buffer_bytes" in records[0]:
        out["kept_buffer_bytes"] = [r["kept_buffer_bytes"] for r in records]
    if "stall_s" in lead[0]:
        out["stall_s"] = [_median([s["stall_s"] for s in r["steps"][warmup:] or r["steps"]]) for r in records]
        out["bytes_moved"] = []
        for r in records:
            steps = r["steps"][warmup:] or r["steps"]
            pairs = sorted({k for s in steps for k in s.get("bytes_moved", {})})
            out["bytes_moved"].append({k: int(_median([s.get("bytes_moved", {}).get(k, 0) for s in steps]))
                                       for k in pairs})  # fmt: skip
    engine_keys = sorted({k for s in lead for k in s if k.startswith("engine:")})
    if engine_keys:
        out["engine_s"] = {k.removeprefix("engine:"): _median([s.get(k, 0.0) for s in lead]) for k in engine_keys}
    if "engine_timers_missing" in records[0]:
        out["engine_timers_missing"] = records[0]["engine_timers_missing"]
    return out


def _median_of(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, dict):
        return {k: _median_of([v[k] for v in values if k in v]) for k in first}
    if isinstance(first, list):  # per-rank figures: rank by rank
        if first and all(len(v) == len(first) for v in values) and isinstance(first[0], (int, float, dict)):
            return [_median_of([v[i] for v in values]) for i in range(len(first))]
        return first
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        return first
    m = statistics.median(values)
    return int(m) if isinstance(first, int) else m


def merge_rounds(records: list[dict[str, Any]], spec: dict[str, Any]) -> dict[str, Any]:
    """Several rounds of one configuration: step times pooled, peaks the largest, other figures the median."""
    ok = [r for r in records if "step_s" in r]
    if not ok:
        return records[-1]
    errors = [r["error"] for r in records if "error" in r]
    if len(ok) == 1:
        merged = dict(ok[0])
    else:
        merged = {k: _median_of([r[k] for r in ok]) for k in ok[0]}
        merged["step_times_s"] = [t for r in ok for t in r["step_times_s"]]
        merged["step_s"] = statistics.median(merged["step_times_s"])
        merged["step_s_min"] = min(merged["step_times_s"])
        merged["tokens_per_s"] = spec["batch"] * spec["seq"] / merged["step_s"]
        for key in ("peak_rss_bytes", "peak_rss_after_setup_bytes"):
            merged[key] = [max(values) for values in zip(*(r[key] for r in ok), strict=True)]
        merged["max_peak_rss_bytes"] = max(merged["peak_rss_bytes"])
        merged["losses"] = ok[0]["losses"]
    merged["rounds"] = len(ok)
    if errors:  # a round that failed is left out of the figures but named
        merged["round_errors"] = errors
    return merged
