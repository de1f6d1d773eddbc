"""The timed steps of `tools/bench_scale.py`: per step, wall time per phase, the process's disk bytes
(/proc/self/io) per phase, the engine's own counters and the RSS, logged as each step ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from benchlib.measure import disk_io, peak_rss_bytes, rss_bytes
from benchlib.watch import RssWatch

GiB = 1 << 30


def timed_steps(
    engine: Any, data: Iterator[tuple[Any, Any]], warmup: int, steps: int, watch: RssWatch, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """`warmup` then `steps` training steps of `engine` on `data`; one record per step, the warm-ups first."""
    records = []
    sync = _synchronize(engine)
    for i in range(warmup + steps):
        x, y = next(data)
        moved0, stall0, replays0 = dict(engine.bytes_moved), engine.stall_s, _replays(engine)
        io0, t0 = disk_io(), time.perf_counter()
        watch.phase = f"step {i} forward"
        _, loss = engine(x, y)
        loss_value = loss.item()
        io1, t1 = disk_io(), time.perf_counter()
        watch.phase = f"step {i} backward"
        engine.backward(loss)
        sync()  # on a GPU the backward's kernels are done before its time is taken, not inside the step's
        io2, t2 = disk_io(), time.perf_counter()
        watch.phase = f"step {i} optimizer"
        engine.step()
        sync()
        io3, t3 = disk_io(), time.perf_counter()
        watch.phase = "between steps"
        record = {
            "step_s": t3 - t0,
            "forward_s": t1 - t0,
            "backward_s": t2 - t1,
            "optimizer_s": t3 - t2,
            "bytes_read": io3[0] - io0[0],
            "bytes_written": io3[1] - io0[1],
            "read_by_phase": [io1[0] - io0[0], io2[0] - io1[0], io3[0] - io2[0]],
            "written_by_phase": [io1[1] - io0[1], io2[1] - io1[1], io3[1] - io2[1]],
            "stall_s": engine.stall_s - stall0,
            "engine_bytes_moved": {
                k: v - moved0.get(k, 0) for k, v in engine.bytes_moved.items() if v != moved0.get(k, 0)
            },
            # blocks whose gradients were recomputed for this step's deferred update, and of those rebuilt from
            # kept factors (`linear_factors`) rather than by running the block again
            "replays": [now - before for now, before in zip(_replays(engine), replays0, strict=True)],
            "loss": loss_value,
            "rss_bytes": rss_bytes(),
            "sampled_peak_rss_by_phase": [
                watch.per_phase.get(f"step {i} {phase}", 0) for phase in ("forward", "backward", "optimizer")
            ],
        }
        records.append(record)
        which = f"warm-up {i + 1}/{warmup}" if i < warmup else f"step {i + 1 - warmup}/{steps}"
        log(
            f"{which}: {record['step_s']:.2f} s "
            f"(fwd {record['forward_s']:.2f}, bwd {record['backward_s']:.2f}, opt {record['optimizer_s']:.2f}), "
            f"read {record['bytes_read'] / 1e9:.2f} GB, written {record['bytes_written'] / 1e9:.2f} GB, "
            f"stall {record['stall_s']:.2f} s, loss {loss_value:.4f}, RSS {record['rss_bytes'] / GiB:.2f} GiB "
            f"(peak {peak_rss_bytes() / GiB:.2f})"
        )
    return records


def _replays(engine: Any) -> tuple[int, int]:
    """(blocks replayed, of those rebuilt from factors) so far."""
    replay = getattr(engine, "grad_replay", None)
    return (replay.replayed_blocks, replay.inputs.factored_blocks) if replay is not None else (0, 0)


def _synchronize(engine: Any) -> Callable[[], None]:
    """Waits for the engine's device (a GPU's queued kernels); nothing on the CPU."""
    import torch

    device = getattr(engine, "device", None)
    if device is not None and torch.device(device).type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
