"""The disk probe: a direct-I/O write and read of the swap directory through the project's aio engine,
every byte verified, nothing left behind, recorded in the trace's meta line when the profiler opens."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from infinity.config import load_config
from infinity.profiler import open_trace_writer
from infinity.profiler.disk_probe import PROBE_BYTES, probe_disk, probe_swap_directory

pytest_plugins = ["storage_fixtures"]  # real directories: a direct-I/O disk


def test_the_probe_measures_both_directions_with_direct_io_and_leaves_no_file(disk_dir: Path) -> None:
    before = set(os.listdir(disk_dir))
    raw = probe_disk(str(disk_dir), nbytes=8 << 20)
    assert raw["read_gbps"] > 0 and raw["write_gbps"] > 0
    assert raw["backend"] == "odirect" and raw["probe_bytes"] == 8 << 20 and raw["path"] == str(disk_dir)
    assert set(os.listdir(disk_dir)) == before


def test_a_probe_size_that_direct_io_cannot_move_is_refused(disk_dir: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        probe_disk(str(disk_dir), nbytes=1000)


def _config(nvme: Path | None, trace_dir: Path):
    offload = {"device": "nvme", "nvme_path": str(nvme)} if nvme is not None else {"device": "none"}
    return load_config({"zero_optimization": {"offload_param": offload, "offload_optimizer": offload},
                        "profiler": {"path": str(trace_dir)}})  # fmt: skip


def test_the_profiler_probes_the_swap_directory_when_it_opens(disk_dir: Path, tmp_path: Path) -> None:
    w = open_trace_writer(_config(disk_dir, tmp_path / "t"), 0, 1, enabled=True)
    w.close()
    meta = json.loads((tmp_path / "t" / "trace_rank0.jsonl").read_text().splitlines()[0])
    assert meta["raw_disk"]["path"] == str(disk_dir) and meta["raw_disk"]["probe_bytes"] == PROBE_BYTES
    assert meta["raw_disk"]["read_gbps"] > 0 and meta["raw_disk"]["backend"] == "odirect"


def test_no_nvme_or_no_directory_yet_means_no_probe(tmp_path: Path) -> None:
    assert probe_swap_directory(_config(None, tmp_path / "t")) is None
    assert probe_swap_directory(_config(tmp_path / "missing", tmp_path / "t")) is None  # the store says why
