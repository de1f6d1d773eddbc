"""The shipped byte corpus and deterministic, rank-sliced, resumable batches drawn from it."""

from __future__ import annotations

import gzip
from importlib import resources
from typing import Any

import torch

CORPUS_FILE = "shakespeare.txt.gz"  # provenance and license: README beside this file
VAL_FRACTION = 0.1


def load_corpus(split: str = "all") -> torch.Tensor:
    """The corpus as a 1-D long tensor of byte values; "train" is the first 90%, "val" the last 10%."""
    raw = gzip.decompress(resources.files("infinity.data").joinpath(CORPUS_FILE).read_bytes())
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    cut = int(len(tokens) * (1 - VAL_FRACTION))
    splits = {"all": tokens, "train": tokens[:cut], "val": tokens[cut:]}
    if split not in splits:
        raise ValueError(f"unknown split {split!r}; choose one of {sorted(splits)}")
    return splits[split]


class ByteBatches:
    """Iterator of `(x, y)` long tensors of shape (batch_size, block_size), y being x shifted by one token.

    Micro-step s draws one global batch of world_size * batch_size random windows from a generator seeded
    by (seed, s); rank r keeps rows [r * batch_size, (r + 1) * batch_size). Hence N ranks with batch_size b
    see, concatenated in rank order, exactly the batch that one rank with batch_size N * b sees. The only
    state is the micro-step counter, so a resumed run (even at another world size with the same global
    batch) continues the same stream.
    """

    def __init__(
        self, tokens: torch.Tensor, batch_size: int, block_size: int, seed: int = 0, rank: int = 0, world_size: int = 1
    ) -> None:
        if tokens.dim() != 1 or len(tokens) <= block_size:
            raise ValueError(f"tokens must be 1-D and longer than block_size={block_size}; got {tuple(tokens.shape)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
        self.tokens = tokens
        self.batch_size = batch_size
        self.block_size = block_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.step = 0

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def __iter__(self) -> ByteBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.step) % 2**63)
        starts = torch.randint(len(self.tokens) - self.block_size, (self.global_batch_size,), generator=gen)
        starts = starts[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        idx = starts[:, None] + torch.arange(self.block_size)
        self.step += 1
        return self.tokens[idx], self.tokens[idx + 1]

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "block_size": self.block_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state["step"]`; the stream's identity (seed, global batch, block size) must match."""
        for key in ("seed", "global_batch_size", "block_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume ByteBatches: saved {key}={state[key]}, this one has {getattr(self, key)}"
                )
        self.step = state["step"]
