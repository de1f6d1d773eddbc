"""One rank of the two-node test: train the toy GPT with everything on this node's NVMe folder.

Run under torchrun (one agent per node); writes this rank's losses and full weights to OUT/rank{RANK}.pt.
The NVMe folder is node-local: each node names its own with --nvme; the output folder stands for the
shared filesystem checkpoints would go to.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the harness and toy models

from harness import config  # noqa: E402
from toy_models import batches, make_model  # noqa: E402

import infinity  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nvme", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-bs", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = config(
        micro_bs=args.micro_bs, persistence=64, offload_param="nvme", offload_optimizer="nvme", nvme_path=args.nvme
    )
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    rank, world = engine.comm.rank, engine.comm.world_size
    data = batches("gpt", args.micro_bs, rank=rank, world_size=world)
    losses = []
    for _ in range(args.steps):
        x, y = next(data)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    swap_here = sorted(p.name for p in Path(args.nvme).iterdir())
    engine.close()
    out = {"rank": rank, "world": world, "node": os.environ.get("GROUP_RANK"), "losses": losses, "state": state}
    out["swap_files"] = swap_here
    torch.save(out, Path(args.out) / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
