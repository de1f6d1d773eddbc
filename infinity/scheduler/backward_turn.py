"""Which blocks stay gathered from their last forward use into backward, where backward starts.

Backward runs the blocks in about the reverse order of forward, and its first prefetch gathers the first
block of backward and the blocks after it within the prefetch bucket. Resharding those blocks at the end
of their forward only to gather them again a moment later costs a gather each and saves no peak memory:
the weights are back before backward's first block runs. So they stay gathered, as DeepSpeed's
`stage3_max_reuse_distance` keeps a parameter used again soon and torchtitan keeps FSDP2's last block.
"""

from __future__ import annotations

from collections.abc import Callable


def kept_for_backward(
    forward_order: list[int],
    backward_order: list[int],
    numel_of: Callable[[int], int],
    prefetch_bucket_elems: int,
    max_live_elems: int,
    max_reuse_distance_elems: int,
) -> set[int]:
    """The blocks (indices) to keep gathered from their last forward use until their backward, given the
    recorded orders: the first block of backward, then the next ones in backward's order as its first
    prefetch would take them (within the bucket, a non-zero bucket always taking the next block, never
    past `max_live_elems` in all), each only if the elements gathered between its last forward use and its
    first backward use are at most `max_reuse_distance_elems`."""
    if not forward_order or not backward_order:
        return set()
    after_forward: dict[int, int] = {}  # elements gathered in forward after each block's last use there
    tail = 0
    for index in reversed(forward_order):
        after_forward.setdefault(index, tail)
        tail += numel_of(index)
    kept: set[int] = set()
    budget, live, before = prefetch_bucket_elems, 0, 0
    for position, index in enumerate(backward_order):
        if index in kept:
            before += numel_of(index)
            continue
        numel = numel_of(index)
        if index not in after_forward or after_forward[index] + before > max_reuse_distance_elems:
            break
        if position > 0:
            first = 0 < budget == prefetch_bucket_elems
            if numel > budget and not first:
                break
            budget = max(0, budget - numel)
        if live + numel > max_live_elems:
            break
        kept.add(index)
        live += numel
        before += numel
    return kept
