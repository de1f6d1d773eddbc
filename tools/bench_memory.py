"""Per-rank host memory of a model whose states dominate: DDP, FSDP2 and infinity on N ranks, infinity on one.

A GPT of d 1024 and 24 layers (byte vocabulary, about 303M parameters; the exact count is in the
JSON), batch 1 x 32 tokens per rank, fp32, offload none, trained `--steps` steps by each configuration
in its own processes (benchlib.launch, as tools/bench_train.py does), with glibc's default malloc
settings: every MALLOC_* variable and GLIBC_TUNABLES are removed from the children's environment.
Per configuration and rank:

    rss_at_start_bytes       VmRSS after importing torch and the framework, before the model is built
    rss_after_setup_bytes    VmRSS once the model is built and wrapped (engine / optimizer ready)
    rss_after_steps_bytes    VmRSS after the steps
    peak_rss_bytes           VmHWM at the end (model construction included: every rank builds it in full)
    state_bytes              rss_after_steps - rss_at_start: what the model, its gradients and optimizer
                             state (and whatever the heap kept) added
    kept_buffer_bytes        infinity: of state_bytes, the host memory its engine keeps between steps for
                             gathers, reductions and held gradients (engine.kept_buffer_bytes): a window of
                             whole blocks, not sharded
    live_state_bytes         the same growth counted in bytes malloc has lent and not had back (glibc's
                             mallinfo2, in heaps and mapped), so without the freed memory malloc keeps resident
                             for reuse (activations and per-step temporaries of every size); glibc only
    malloc_kept_bytes        state_bytes - live_state_bytes: that freed memory, resident

`ratio_to_fsdp2` divides the largest rank's figure by FSDP2's largest rank's; `infinity_state_ratio`
is infinity's per-rank state_bytes on N ranks over its state_bytes on one rank (1/N if the model
state shards perfectly), `infinity_sharded_state_ratio` the same without kept_buffer_bytes, and
`infinity_model_state_ratio` the same in live bytes without kept_buffer_bytes: the model state alone
(weights, gradients and optimizer moments). `state_ratio` gives each configuration run on both N
ranks and one its own state_bytes ratio (FSDP2's, if asked for with --one-rank).

    python tools/bench_memory.py [--ranks 2] [--n-embd 1024] [--n-layer 24] [--steps 2] [--configs ...]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from benchlib.launch import kill_running, run_configuration
from benchlib.scratch import install_signal_handlers, remove_stale_dirs, scratch_dir
from benchlib.trainers import CONFIGS, resolve_names

SEED = 1234
SCRATCH_PREFIX = ".bench-memory-"
FIGURES = ("rss_after_setup_bytes", "rss_after_steps_bytes", "peak_rss_bytes")
ONE_RANK_SUFFIX = "@1rank"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-layer", type=int, default=24)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--configs", default="ddp,fsdp2_none,infinity_z3_none", help="run on --ranks ranks")
    parser.add_argument("--one-rank", default="infinity_z3_none", help="also run these on one rank ('' for none)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    parser.add_argument("--json", action="store_true", help="(the JSON line is always printed last)")
    args = parser.parse_args(argv)
    try:
        args.names = resolve_names([n.strip() for n in args.configs.split(",") if n.strip()])
        args.one_rank_names = resolve_names([n.strip() for n in args.one_rank.split(",") if n.strip()])
    except ValueError as exc:
        parser.error(str(exc))
    return args


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    if "step_s" not in record:
        return {"error": record.get("error", "?")}
    out = {k: record[k] for k in ("ranks", "rss_at_start_bytes", *FIGURES, "model_params", "losses")}
    out["state_bytes"] = [a - b for a, b in zip(record["rss_after_steps_bytes"], record["rss_at_start_bytes"],
                                                 strict=True)]  # fmt: skip
    if "kept_buffer_bytes" in record:
        out["kept_buffer_bytes"] = record["kept_buffer_bytes"]
    if "malloc_live_after_steps_bytes" in record:
        after, start = record["malloc_live_after_steps_bytes"], record["malloc_live_at_start_bytes"]
        out["live_state_bytes"] = [a - b for a, b in zip(after, start, strict=True)]
        out["malloc_kept_bytes"] = [a - b for a, b in zip(out["state_bytes"], out["live_state_bytes"], strict=True)]
    return out


def _per_rank_ratio(many: dict[str, Any], one: dict[str, Any], key: str, less: str | None = None) -> float | None:
    """The largest rank's `key` on N ranks over the one rank's, each less `less` where given; None if absent."""
    if key not in many or key not in one or (less is not None and (less not in many or less not in one)):
        return None

    def figure(row: dict[str, Any]) -> int:
        minus = row[less] if less is not None else [0] * len(row[key])
        return max(a - b for a, b in zip(row[key], minus, strict=True))

    return figure(many) / figure(one)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install_signal_handlers(on_signal=kill_running)
    malloc_env = sorted(k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")
    spec = {
        "model_size": "110m",
        "model_overrides": {"n_embd": args.n_embd, "n_layer": args.n_layer, "n_head": args.n_head},
        "seq": args.seq,
        "steps": args.steps,
        "warmup": 0,
        "dtype": args.dtype,
        "clip": 0.0,
        "seed": SEED,
        "engine_timers": False,
        "threads": 1,
    }
    runs = [(name, args.ranks) for name in args.names] + [(name, 1) for name in args.one_rank_names]
    rows: dict[str, dict[str, Any]] = {}
    base = Path(".").resolve()
    remove_stale_dirs(base, SCRATCH_PREFIX)
    with scratch_dir(base, SCRATCH_PREFIX) as workdir:
        for name, ranks in runs:
            row = name if ranks == args.ranks else name + ONE_RANK_SUFFIX
            print(f"== {row}", flush=True)
            ranks = ranks if CONFIGS[name].distributed else 1
            record = run_configuration({**spec, "name": name, "batch": args.batch * ranks}, ranks, workdir,
                                       args.timeout, env_unset=tuple(malloc_env))  # fmt: skip
            rows[row] = summarize(record)
    fsdp2 = rows.get("fsdp2_none", {})
    for row in rows.values():
        if "peak_rss_bytes" in row and "peak_rss_bytes" in fsdp2:
            row["ratio_to_fsdp2"] = {k.removesuffix("_bytes"): max(row[k]) / max(fsdp2[k]) for k in FIGURES}
    one, many = rows.get("infinity_z3_none" + ONE_RANK_SUFFIX, {}), rows.get("infinity_z3_none", {})
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:28s} ERROR {row['error'].splitlines()[0][:300]}")
            continue
        gib = {k.removesuffix("_bytes"): " ".join(f"{v / 2**30:.2f}" for v in row[k])
               for k in (*FIGURES, "state_bytes")}  # fmt: skip
        labels = (("live", "live_state_bytes"), ("kept buffers", "kept_buffer_bytes"))
        parts = [f"{label} " + " ".join(f"{v / 2**30:.2f}" for v in row[key]) for label, key in labels if key in row]
        extra = f" ({', '.join(parts)})" if parts else ""
        print(f"{name:28s} GiB per rank: setup {gib['rss_after_setup']}, after steps {gib['rss_after_steps']}, "
              f"peak {gib['peak_rss']}, state {gib['state']}{extra}")  # fmt: skip
    params = next((r["model_params"] for r in rows.values() if "model_params" in r), None)
    summary: dict[str, Any] = {
        "rows": rows,
        "model": {**spec["model_overrides"], "params": params},
        "ranks": args.ranks,
        "batch_per_rank": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "dtype": args.dtype,
        "malloc_env_removed": malloc_env,
        "load_average": os.getloadavg(),
    }
    ratios = {
        "infinity_state_ratio": _per_rank_ratio(many, one, "state_bytes"),
        "infinity_sharded_state_ratio": _per_rank_ratio(many, one, "state_bytes", "kept_buffer_bytes"),
        "infinity_model_state_ratio": _per_rank_ratio(many, one, "live_state_bytes", "kept_buffer_bytes"),
    }
    summary.update({k: v for k, v in ratios.items() if v is not None})
    summary["state_ratio"] = {
        name: _per_rank_ratio(rows[name], rows[name + ONE_RANK_SUFFIX], "state_bytes")
        for name in args.names
        if "error" not in rows[name] and "error" not in rows.get(name + ONE_RANK_SUFFIX, {"error": ""})
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
