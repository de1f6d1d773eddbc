"""Profiler overhead: the same NVMe-offloaded training with the profiler off and on, interleaved in one run.

Prints one JSON object on its last line: median step seconds off and on, and `overhead` = on/off - 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import infinity
from infinity.data.corpus import ByteBatches, load_corpus
from infinity.models.gpt import GPT, gpt_preset


def _config(nvme: str, trace: str | None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "block_classes": ["Block"],
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
        },
    }
    if trace is not None:
        cfg["profiler"] = {"enabled": True, "path": trace}
    return cfg


def step_times(model: str, steps: int, profile: bool) -> list[float]:
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        torch.manual_seed(0)
        engine, *_ = infinity.initialize(
            model=GPT(gpt_preset(model, block_size=64)), config=_config(tmp, f"{tmp}/trace" if profile else None)
        )
        data = ByteBatches(load_corpus(), 8, 64, seed=0)
        times = []
        for _ in range(steps + 1):  # the first step records the trace and warms up
            x, y = next(data)
            start = time.perf_counter()
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - start)
        engine.close()
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    off: list[float] = []
    on: list[float] = []
    for r in range(args.rounds):  # interleaved: the machine's speed drifts
        off += step_times(args.model, args.steps, profile=False)
        on += step_times(args.model, args.steps, profile=True)
        print(f"round {r}: off {statistics.median(off):.4f} s/step, on {statistics.median(on):.4f} s/step")
    result = {
        "model": args.model,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "off_step_s": statistics.median(off),
        "on_step_s": statistics.median(on),
        "overhead": statistics.median(on) / statistics.median(off) - 1,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
