"""One rank of one benchmarked configuration: `python -m benchlib.train_child --spec JSON` (or under torchrun).

Builds the GPT (same seed on every rank), wraps it for the configuration, runs `warmup + steps`
steps on the shipped corpus (rank r takes its slice of each global batch) and writes its record to
`<record_dir>/rank<r>.json`: per-step times, loss, phases and counters, and its resident memory
(VmRSS after imports, after building the model, after setup and after the steps; VmHWM after setup
and at the end). A failure is written there as {"error", "traceback"}. The process then leaves
with os._exit, skipping the interpreter's and the process group's teardown: not measured, and on
Gloo it now and then aborts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchlib.measure import malloc_live_bytes, peak_rss_bytes, rss_bytes
from benchlib.trainers import CONFIGS, StepOptions, build_trainer, import_framework


def build_model(spec: dict[str, Any]) -> torch.nn.Module:
    from infinity.models.gpt import GPT, gpt_preset

    torch.manual_seed(spec["seed"])
    return GPT(gpt_preset(spec["model_size"], **spec.get("model_overrides", {})))


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "stall_s" in after:
        out["stall_s"] = after["stall_s"] - before.get("stall_s", 0.0)
    if "bytes_moved" in after:
        was = before.get("bytes_moved", {})
        out["bytes_moved"] = {k: v - was.get(k, 0) for k, v in after["bytes_moved"].items() if v != was.get(k, 0)}
    return out


def run(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    from infinity.data import ByteBatches, load_corpus

    cfg = CONFIGS[spec["name"]]
    torch.set_flush_denormal(True)  # decaying weights in denormals slow CPU steps several-fold
    torch.set_num_threads(spec["threads"])
    if cfg.framework in ("ddp", "fsdp2"):
        import torch.distributed as dist

        dist.init_process_group("gloo")  # env from torchrun, or set by the launcher for one rank
    if spec["batch"] % world:
        raise ValueError(f"global batch {spec['batch']} does not divide over {world} ranks")
    micro = spec["batch"] // world
    import_framework(cfg)
    record: dict[str, Any] = {"rank": rank, "world": world, "rss_at_start_bytes": rss_bytes(),
                              "malloc_live_at_start_bytes": malloc_live_bytes()}  # fmt: skip
    model = build_model(spec)
    record["model_params"] = sum(p.numel() for p in model.parameters())
    record["rss_after_build_bytes"] = rss_bytes()
    opts = StepOptions(micro, spec["dtype"], spec["clip"], spec["nvme_path"], spec["threads"], spec["engine_timers"],
                       spec.get("profile_dir"), spec["warmup"])  # fmt: skip
    start = time.perf_counter()
    trainer = build_trainer(model, cfg, opts)
    record["init_s"] = time.perf_counter() - start
    record["rss_after_setup_bytes"] = rss_bytes()
    record["peak_rss_after_setup_bytes"] = peak_rss_bytes()
    batches = ByteBatches(load_corpus("train"), micro, spec["seq"], seed=spec["seed"], rank=rank, world_size=world)
    steps = []
    for i in range(spec["warmup"] + spec["steps"]):
        x, y = next(batches)
        before = trainer.counters()
        start, cpu_start, usage = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        rec = trainer.step(x, y)
        rec["step_s"] = time.perf_counter() - start
        rec["cpu_s"] = time.process_time() - cpu_start
        after = resource.getrusage(resource.RUSAGE_SELF)
        rec["sys_s"] = after.ru_stime - usage.ru_stime
        rec["page_faults"] = after.ru_minflt - usage.ru_minflt
        rec.update(_delta(trainer.counters(), before))
        steps.append(rec)
        if rank == 0:
            kind = "warm-up" if i < spec["warmup"] else "timed"
            print(f"[{spec['name']}] step {i} {kind} {rec['step_s']:.3f} s loss {rec['loss']:.4f}", flush=True)
    record["rss_after_steps_bytes"] = rss_bytes()
    record["malloc_live_after_steps_bytes"] = malloc_live_bytes()
    record["peak_rss_bytes"] = peak_rss_bytes()
    kept = trainer.counters().get("kept_buffer_bytes")
    if kept is not None:
        record["kept_buffer_bytes"] = kept
    missing = trainer.counters().get("engine_timers_missing")
    if missing:
        record["engine_timers_missing"] = missing
    trainer.close()
    record["threads"] = torch.get_num_threads()
    record["steps"] = steps
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="JSON: the configuration and run settings (see launch.py)")
    spec = json.loads(parser.parse_args().spec)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    path = Path(spec["record_dir"]) / f"rank{rank}.json"
    code = 0
    try:
        record = run(spec, rank, world)
    except Exception as exc:
        record = {"rank": rank, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        code = 1
    path.write_text(json.dumps(record))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
