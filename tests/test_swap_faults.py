"""Fault injection through the engine's public API: a swap file truncated, overwritten, bit-flipped, deleted
or replaced mid-run stops the run within one step with an error naming the file, on 1 and 2 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist import RankError, run_distributed
from fault_cases import FAULTS, FaultCaught, train_with_fault

EXPECTED = {
    "truncate": ("SwapFileChangedError", "truncated"),
    "overwrite": ("ChecksumError", "are not the ones written"),
    "bitflip": ("ChecksumError", "are not the ones written"),
    "delete": ("SwapFileChangedError", "was deleted"),
    "replace": ("SwapFileChangedError", "was replaced"),
}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("world", [1, 2])
def test_a_damaged_swap_file_stops_the_run_within_one_step(tmp_path: Path, world: int, fault: str) -> None:
    fault_rank = world - 1  # on two ranks the damage is to rank 1's file: rank 0 is not special
    with pytest.raises(RankError) as info:
        run_distributed(train_with_fault, world, str(tmp_path), fault, fault_rank, timeout_s=240)
    caught = info.value.exception
    assert info.value.rank == fault_rank and isinstance(caught, FaultCaught), str(info.value)
    kind, words = EXPECTED[fault]
    swap = str(tmp_path / f"infinity-rank{fault_rank}.swap")
    assert caught.steps_after_fault == 0, caught.message  # the first step after the damage stops
    assert caught.kind == kind and words in caught.message and swap in caught.message, caught.message
    # the first I/O to meet the damage names its shard once: a fetch, or the write-behind of a step owed to the
    # next forward (the NVMe optimizer's deferred step)
    named = caught.message.count("fetch of") + caught.message.count("write of")
    assert "resume from its last checkpoint" in caught.message and named == 1
    assert caught.swap_left == (fault == "replace")  # close removes its own file, never a replacement
