"""The disk a bench_scale run needs on its NVMe path, and the check before anything is written there."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib import shapes

GiB = 1 << 30
MARGIN_BYTES = 1 * GiB  # swap-file growth steps, slot alignment, the filesystem's own reserve


def disk_need(arch: str, cfg: Any, compute_bytes: int, moments: str, fio_bytes: int, clip: bool) -> dict[str, Any]:
    """Bytes the run needs on the NVMe path: infinity.estimator's swap figure, fio's file and a margin."""
    from infinity.estimator import ModelSize, estimate

    size = ModelSize(shapes.count(arch, cfg), shapes.largest_block_params(arch, cfg))
    # gradients take NVMe slots only where they wait for the step: with clipping (accumulation is 1 here)
    swap = estimate(size, "nvme", "nvme", dtype_bytes=compute_bytes, moments=moments, clip=clip).nvme_bytes
    how = f"infinity.estimator, moments {moments}, clipping {'on' if clip else 'off'}"
    return {
        "swap_bytes": swap,
        "fio_bytes": fio_bytes,
        "margin_bytes": MARGIN_BYTES,
        "total_bytes": max(swap, fio_bytes) + MARGIN_BYTES,  # fio's file is removed before the swap is made
        "swap_estimate": how,
    }


def check_disk(base: Path, need: dict[str, Any], params: int, log: Callable[[str], None]) -> int:
    """Free bytes at `base` (logged beside `need`); SystemExit naming what fits when `need` does not."""
    free = shutil.disk_usage(base).free
    log(f"disk: the run needs {need['total_bytes'] / 1e9:.1f} GB on {base} (the larger of "
        f"{need['swap_bytes'] / 1e9:.1f} swap [{need['swap_estimate']}] and {need['fio_bytes'] / 1e9:.1f} fio, + "
        f"{MARGIN_BYTES / 1e9:.1f} margin); "
        f"{free / 1e9:.1f} GB free")  # fmt: skip
    if need["total_bytes"] > free:
        most = (free - MARGIN_BYTES) / (need["swap_bytes"] / params)
        raise SystemExit(
            f"not enough disk on {base}: the run needs {need['total_bytes'] / 1e9:.1f} GB, {free / 1e9:.1f} GB is "
            f"free; ask for fewer parameters (--params {max(most, 0):.3g} fits) or point --nvme-path at a bigger disk"
        )
    return free
