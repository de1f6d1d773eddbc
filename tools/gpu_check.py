"""`make gpu-check`: on a machine with a GPU, build what is missing, run the `cuda` tests and a short GPU
benchmark, and print one JSON line; on a CPU-only machine, say so in one line and exit 0.

    python tools/gpu_check.py [--budget-s 470] [--model 1b] [--batch 8] [--seq 1024] [--log-dir DIR]
                              [--skip-tests] [--skip-bench]

Parts, each in its own process (group) with a timeout inside the whole budget (8 minutes by default), so
one that fails or hangs is reported in the JSON and the others still run:

    install         the native module built in place with this Python (nothing is downloaded)
    tests           pytest -m cuda (tests/test_gpu.py: the engine against plain PyTorch on the GPU, the
                    gradient bytes to the host, no op mixing host and device memory)
    compute         plain PyTorch forward+backward of the model in bf16 with its weights resident on the
                    GPU, timed with CUDA events: the least GPU time a training step needs
    infinity_cpu    infinity ZeRO-3, bf16, params and optimizer offloaded to cpu
    infinity_nvme   ... to nvme (swap files under --nvme-path, removed after)
    deepspeed_cpu, deepspeed_nvme   DeepSpeed ZeRO-3 with the same offload, where deepspeed is importable

Per training configuration: steps/s (the median timed step), tokens/s, the GPU busy fraction (compute's
fwd+bwd time over the step time), the compute's waits for weights, bytes moved per step between tiers.
The last line printed is the JSON object; the exit code is 0 when every part that ran passed.
`--smoke-on-cpu` runs the same parts on the CPU with a tiny model (to develop this script without a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_NVME_PATH = str(REPO / ".gpu-check-nvme")
HYPER = {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
SEED = 1234
CAPS_S = {"install": 180, "tests": 200, "compute": 60, "infinity_cpu": 100, "infinity_nvme": 140}
CAP_OTHER_S = 100


# -- the parent: parts in subprocesses, one JSON line ------------------------------------------------------


LOG_DIR: Path | None = None  # --log-dir: each part's whole output is kept there


def run_part(cmd: list[str], timeout_s: float, env: dict[str, str], name: str | None = None) -> dict[str, Any]:
    """Run `cmd` in its own process group; its exit code, seconds and output (the group is killed at the
    timeout, stray ranks included)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    with contextlib.suppress(ProcessLookupError):  # anything it left behind (forked ranks)
        os.killpg(proc.pid, signal.SIGKILL)
    result: dict[str, Any] = {"rc": proc.returncode, "s": round(time.monotonic() - start, 1), "out": out or ""}
    if LOG_DIR is not None and name is not None:
        (LOG_DIR / f"{name}.log").write_text(" ".join(cmd) + "\n" + result["out"])
    if timed_out:
        result["error"] = f"timed out after {timeout_s:.0f} s"
    elif proc.returncode != 0:
        result["error"] = f"exit code {proc.returncode}"
    return result


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)
    return None


class Budget:
    def __init__(self, total_s: float) -> None:
        self.deadline = time.monotonic() + total_s

    def for_part(self, name: str) -> float:
        """Seconds the part may take: its cap, within what is left (a few kept for the report)."""
        return min(CAPS_S.get(name, CAP_OTHER_S), self.deadline - time.monotonic() - 5)


def install(py: str, env: dict[str, str], budget: Budget) -> dict[str, Any]:
    """Build the native module in place where this Python cannot import it; check the runtime imports."""
    missing = [m for m in ("numpy", "aiofiles", "cpuinfo", "pytest") if importlib.util.find_spec(m) is None]
    if missing:
        return {"error": f"Python modules missing: {missing}: pip install numpy aiofiles py-cpuinfo pytest"}
    probe = [py, "-c", "import infinity._native"]
    if run_part(probe, 60, env)["rc"] == 0:
        return {"built": False, "s": 0.0}
    built = run_part([py, "setup.py", "-q", "build_ext", "--inplace"], budget.for_part("install"), env, "install")
    if "error" in built:
        return {"error": built["error"], "tail": _tail(built["out"])}
    return {"built": True, "s": built["s"]}


def run_tests(py: str, env: dict[str, str], budget: Budget, need_passes: bool) -> dict[str, Any]:
    cmd = [py, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    cmd.append("tests/")
    part = run_part(cmd, budget.for_part("tests"), env, "tests")
    summary = {k: 0 for k in ("passed", "failed", "errors", "skipped")}
    counts = re.compile(r"\d+ (passed|failed|error|skipped)")
    last = next((ln for ln in reversed(part["out"].splitlines()) if counts.search(ln)), "")
    for count, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last):
        summary["errors" if word.startswith("error") else word] = int(count)
    result: dict[str, Any] = {**summary, "s": part["s"]}
    if "error" in part or summary["failed"] or summary["errors"] or (need_passes and not summary["passed"]):
        result["error"] = part.get("error", "tests failed")
        failed = [ln for ln in part["out"].splitlines() if ln.startswith(("FAILED", "ERROR"))]
        result["failures"] = failed[:20]
        result["tail"] = _tail(part["out"], 25)
    return result


def bench(py: str, env: dict[str, str], budget: Budget, args: argparse.Namespace) -> dict[str, Any]:
    names = ["compute", "infinity_cpu", "infinity_nvme"]
    if importlib.util.find_spec("deepspeed") is not None:
        names += ["deepspeed_cpu", "deepspeed_nvme"]
    out: dict[str, Any] = {"model": args.model, "batch": args.batch, "seq": args.seq}
    if "deepspeed_cpu" not in names:
        out["deepspeed"] = "not installed: no comparison"
    for name in names:
        timeout = budget.for_part(name)
        if timeout < 20:
            out[name] = {"skipped": "no time left in the budget"}
            continue
        child_env = dict(env)
        if name.startswith("deepspeed_"):
            one_rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
            child_env.update(one_rank, MASTER_PORT=str(_port()))
        cmd = [py, str(Path(__file__).resolve()), "--child", name, "--model", args.model, "--batch", str(args.batch),
               "--seq", str(args.seq), "--nvme-path", args.nvme_path, "--time-limit-s", str(timeout - 15)]  # fmt: skip
        if args.smoke_on_cpu:
            cmd.append("--smoke-on-cpu")
        part = run_part(cmd, timeout, child_env, name)
        record = _last_json(part["out"])
        if record is None:
            record = {"error": part.get("error", "no result"), "tail": _tail(part["out"])}
        elif "error" in part:
            record["error"] = part["error"]
        out[name] = record
    if args.nvme_path == DEFAULT_NVME_PATH:  # ours, made for this run (infinity removes its files; DeepSpeed not)
        shutil.rmtree(args.nvme_path, ignore_errors=True)
    compute_s = out.get("compute", {}).get("fwd_bwd_s")
    for name in names[1:]:
        record = out[name]
        if compute_s and record.get("step_s"):
            record["gpu_busy_fraction"] = round(compute_s / record["step_s"], 4)
    for offload in ("cpu", "nvme"):
        ours, theirs = out.get(f"infinity_{offload}", {}), out.get(f"deepspeed_{offload}", {})
        if ours.get("step_s") and theirs.get("step_s"):
            out[f"infinity_{offload}_speedup_vs_deepspeed"] = round(theirs["step_s"] / ours["step_s"], 3)
    return out


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failed(part: dict[str, Any]) -> bool:
    if not isinstance(part, dict):
        return False
    return "error" in part or any(_failed(v) for v in part.values() if isinstance(v, dict))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=470.0, help="seconds for everything (default: 8 min)")
    parser.add_argument("--model", default="1b", help="GPT preset for the benchmark (infinity.models.gpt)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--nvme-path", default=DEFAULT_NVME_PATH, help="folder for the NVMe swap files")
    parser.add_argument("--log-dir", help="keep each part's whole output there (<part>.log)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--smoke-on-cpu", action="store_true", help="develop without a GPU: a tiny model on the CPU")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--time-limit-s", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0

    import torch

    global LOG_DIR
    if args.log_dir:
        LOG_DIR = Path(args.log_dir)
        LOG_DIR.mkdir(parents=True, exist_ok=True)
    if args.smoke_on_cpu:
        args.model, args.batch, args.seq = "tiny", 2, 32
    elif not torch.cuda.is_available():
        print(json.dumps({"gpu_check": "skipped", "reason": "no GPU is present (torch.cuda.is_available() is False)"}))
        return 0
    start = time.monotonic()
    budget = Budget(args.budget_s)
    py = sys.executable
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")  # fmt: skip
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
    }
    report["install"] = install(py, env, budget)
    if "error" not in report["install"]:
        need_passes = not args.smoke_on_cpu  # on a CPU every cuda test is skipped
        report["tests"] = {"skipped": "--skip-tests"} if args.skip_tests else run_tests(py, env, budget, need_passes)
        report["bench"] = {"skipped": "--skip-bench"} if args.skip_bench else bench(py, env, budget, args)
    report["total_s"] = round(time.monotonic() - start, 1)
    report["ok"] = not any(_failed(report[k]) for k in ("install", "tests", "bench") if k in report)
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


# -- the children: one configuration each ------------------------------------------------------------------


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from infinity.data import ByteBatches, load_corpus
    from infinity.models.gpt import GPT, gpt_preset

    torch.manual_seed(SEED)
    cfg = gpt_preset(args.model, block_size=args.seq)
    data = ByteBatches(load_corpus("train"), args.batch, args.seq, seed=SEED)
    start = time.perf_counter()
    device = torch.device("cpu") if args.smoke_on_cpu else torch.device("cuda", torch.cuda.current_device())
    if args.child == "compute":
        return compute_fwd_bwd(GPT(cfg), data, device)
    offload = args.child.split("_", 1)[1]
    model = GPT(cfg)
    if args.child.startswith("infinity_"):
        engine, close = make_infinity(model, args, offload)
    else:
        engine, close = make_deepspeed(model, args, offload)
    init_s = time.perf_counter() - start
    try:
        return {"init_s": round(init_s, 1), **train_steps(engine, data, args.time_limit_s - init_s, args, device)}
    finally:
        close()


def compute_fwd_bwd(model, data, device) -> dict[str, Any]:
    """Forward+backward of the model in bf16, weights resident on the GPU, timed with CUDA events."""
    import torch

    model = model.to(device, torch.bfloat16)
    times = []
    for i in range(5):
        x, y = (t.to(device) for t in next(data))
        with _DeviceTimer(device) as timer:
            _, loss = model(x, y)
            loss.backward()
        model.zero_grad(set_to_none=True)
        if i >= 2:  # two warm-ups
            times.append(timer.seconds)
    return {"fwd_bwd_s": round(statistics.median(times), 4), "params": sum(p.numel() for p in model.parameters())}


class _DeviceTimer:
    """Seconds the device took for the work queued inside (CUDA events; wall time on the CPU)."""

    def __init__(self, device) -> None:
        self.device = device
        self.seconds = 0.0

    def __enter__(self) -> _DeviceTimer:
        import torch

        if self.device.type == "cuda":
            self._begin, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._begin.record()
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self._end.record()
            self._end.synchronize()
            self.seconds = self._begin.elapsed_time(self._end) / 1e3
        else:
            self.seconds = time.perf_counter() - self._start


def _ds_style_config(args: argparse.Namespace, offload: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": HYPER},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": offload, "nvme_path": args.nvme_path, "pin_memory": True},
            "offload_optimizer": {"device": offload, "nvme_path": args.nvme_path, "pin_memory": True},
        },
        "steps_per_print": 1_000_000,
    }


def make_infinity(model, args: argparse.Namespace, offload: str):
    import infinity

    os.makedirs(args.nvme_path, exist_ok=True)
    config = _ds_style_config(args, offload)
    config["zero_optimization"]["block_classes"] = ["Block"]
    engine, _, _, _ = infinity.initialize(model=model, config=config)
    return engine, engine.close


def make_deepspeed(model, args: argparse.Namespace, offload: str):
    import deepspeed

    os.makedirs(args.nvme_path, exist_ok=True)
    config = _ds_style_config(args, offload)
    config["aio"] = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, lambda: None


def train_steps(engine, data, limit_s: float, args: argparse.Namespace, device) -> dict[str, Any]:
    """One warm-up step, then timed steps while the next one fits in `limit_s`."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    records, started = [], time.perf_counter()
    while True:
        x, y = next(data)
        moved0 = dict(getattr(engine, "bytes_moved", {}))
        stall0 = getattr(engine, "stall_s", 0.0)
        sync()
        begin = time.perf_counter()
        _, loss = engine(x.to(device), y.to(device))
        engine.backward(loss)
        engine.step()
        loss_value = loss.item()
        sync()
        step_s = time.perf_counter() - begin
        moved = {k: v - moved0.get(k, 0) for k, v in getattr(engine, "bytes_moved", {}).items()}
        stall = getattr(engine, "stall_s", 0.0) - stall0
        records.append({"step_s": step_s, "loss": loss_value, "moved": moved, "stall_s": stall})
        elapsed = time.perf_counter() - started
        if len(records) > 1 + 8 or elapsed + step_s * 1.2 > limit_s:
            break
    timed = records[1:] or records  # the warm-up alone when nothing more fits
    step_s = statistics.median(r["step_s"] for r in timed)
    out = {
        "steps": len(timed),
        "warmup_included": len(records) == 1,
        "step_s": round(step_s, 4),
        "steps_per_s": round(1 / step_s, 4),
        "tokens_per_s": round(args.batch * args.seq / step_s, 1),
        "stall_s": round(statistics.median(r["stall_s"] for r in timed), 4),
        "losses": [round(r["loss"], 4) for r in records],
    }
    if device.type == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    pairs = sorted({k for r in timed for k in r["moved"]})
    if pairs:
        out["bytes_moved_per_step"] = {k: int(statistics.median(r["moved"].get(k, 0) for r in timed)) for k in pairs}
    return out


if __name__ == "__main__":
    sys.exit(main())
