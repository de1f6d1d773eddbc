"""Two machines, as torch.distributed sees them: two torchrun agents on this machine (`--nnodes 2`, one
process each), meeting at a c10d rendezvous on localhost, each node with its own NVMe folder. They train
to plain PyTorch's losses and weights; each node's swap file lives in its own folder only."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from harness import assert_matches_reference, reference_for

SCRIPT = Path(__file__).resolve().parent / "scripts" / "multinode_train.py"
STEPS, MICRO_BS = 3, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_like_plain_pytorch(tmp_path):
    port = _free_port()
    out = tmp_path / "shared"
    out.mkdir()
    agents = []
    for node in range(2):
        nvme = tmp_path / f"node{node}-nvme"
        nvme.mkdir()
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "infinity-two-nodes",
            "--max-restarts", "0",
            str(SCRIPT), "--nvme", str(nvme), "--out", str(out), "--steps", str(STEPS), "--micro-bs", str(MICRO_BS),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for agent in agents:
        try:
            logs.append(agent.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for a in agents:
                a.kill()
            raise
    assert all(a.returncode == 0 for a in agents), "\n".join(logs)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert sorted(r["node"] for r in results) == ["0", "1"]  # two nodes, one rank each
    ref = reference_for("gpt", STEPS, 2 * MICRO_BS)
    assert_matches_reference(results, ref.losses, ref.state)
    for r in results:  # each node's swap file was in its own folder, and is gone
        assert r["swap_files"] == [f"infinity-rank{r['rank']}.swap"]
    assert not any(list((tmp_path / f"node{n}-nvme").iterdir()) for n in range(2))
