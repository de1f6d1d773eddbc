"""The tag a checkpoint is saved under, agreed by every rank (`checkpoint.tag_validation`).

Each rank writes its files into `save_dir/tag`, so a save where ranks pass different tags would scatter one
checkpoint over several folders, none of them whole. The ranks compare their tags first (a hash of each, one
all-reduce): "Fail" refuses such a save, naming the tags' disagreement; "Warn" says so and saves every rank
under rank 0's tag. "Ignore" skips the comparison, as DeepSpeed does, and every rank takes rank 0's tag
without a word (else a rank would write into a folder nobody staged, and its peers would wait for it).
"""

from __future__ import annotations

import hashlib
import sys

import torch

from infinity.comm import CommGroup
from infinity.engine.checkpoint_folder import CheckpointError

_MAX_TAG_BYTES = 4096


def _tag_hash(tag: str) -> int:
    return int.from_bytes(hashlib.sha256(tag.encode()).digest()[:7], "little")  # < 2**56: exact in int64


def agree_on_tag(comm: CommGroup, tag: str, validation: str) -> str:
    """The tag this rank saves under: `tag` where every rank passed the same one, else rank 0's with a warning
    ("Warn") or silently ("Ignore"), else a CheckpointError ("Fail"). Every rank calls it."""
    if comm.world_size == 1:
        return tag
    if validation == "Ignore":
        return _broadcast_text(comm, tag)
    h = _tag_hash(tag)
    extremes = torch.tensor([h, -h], dtype=torch.int64, device=comm.device)
    comm.all_reduce(extremes, "checkpoint tag comparison", op="max")
    if extremes[0].item() == -extremes[1].item():  # the largest hash is the smallest: one tag
        return tag
    if validation == "Fail":
        raise CheckpointError(
            f"save_checkpoint was given different tags on different ranks (rank {comm.rank}: {tag!r}); pass the "
            "same tag on every rank, or none (each then saves under global_step<N>), or set "
            "'checkpoint.tag_validation' to \"Warn\" to save under rank 0's tag"
        )
    first = _broadcast_text(comm, tag)
    if comm.rank == 0:
        print(
            f"infinity: save_checkpoint was given different tags on different ranks; every rank saves under rank "
            f'0\'s tag {first!r} (checkpoint.tag_validation is "Warn"; "Fail" refuses such a save)',
            file=sys.stderr,
        )
    return first


def _broadcast_text(comm: CommGroup, text: str) -> str:
    """Rank 0's `text` on every rank (a tag is a folder name: far shorter than the buffer, and without NUL)."""
    data = list(text.encode()[:_MAX_TAG_BYTES])
    buffer = torch.zeros(_MAX_TAG_BYTES, dtype=torch.uint8)
    buffer[: len(data)] = torch.tensor(data, dtype=torch.uint8)
    buffer = comm.broadcast(buffer.to(comm.device), 0, "checkpoint tag")
    return bytes(buffer.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
