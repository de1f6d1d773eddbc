"""Which blocks stay gathered from forward into backward (`kept_for_backward`), computed by hand."""

from __future__ import annotations

import pytest

from infinity.scheduler.backward_turn import kept_for_backward

pytestmark = pytest.mark.unit

S = 1000
BIG = 10**12


def _kept(forward, backward, sizes=None, bucket=0, max_live=BIG, reuse=BIG):
    sizes = sizes or {i: S for i in set(forward) | set(backward)}
    return kept_for_backward(forward, backward, sizes.__getitem__, bucket, max_live, reuse)


def test_nothing_is_kept_before_both_orders_are_recorded():
    assert _kept([], [3, 2, 1, 0], sizes={0: S, 1: S, 2: S, 3: S}) == set()
    assert _kept([0, 1, 2, 3], []) == set()


def test_a_zero_bucket_keeps_only_the_first_block_of_backward():
    assert _kept([0, 1, 2, 3], [3, 2, 1, 0], bucket=0) == {3}


def test_the_bucket_keeps_the_blocks_backwards_first_prefetch_would_gather():
    # the first block of backward, then two more within a bucket of 2S (the prefetch's rule)
    assert _kept([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], bucket=2 * S) == {4, 3, 2}
    assert _kept([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], bucket=2 * S - 1) == {4, 3}


def test_a_non_zero_bucket_always_takes_the_next_block():
    sizes = {0: S, 1: S, 2: 4 * S, 3: S}
    assert _kept([0, 1, 2, 3], [3, 2, 1, 0], sizes=sizes, bucket=1) == {3, 2}


def test_the_reuse_distance_counts_elements_gathered_in_forward_after_and_in_backward_before():
    # block 2: block 3 after it in forward (S) and block 3 before it in backward (S): 2S apart
    forward, backward = [0, 1, 2, 3], [3, 2, 1, 0]
    assert _kept(forward, backward, bucket=BIG, reuse=2 * S) == {3, 2}
    assert _kept(forward, backward, bucket=BIG, reuse=2 * S - 1) == {3}
    assert _kept(forward, backward, bucket=BIG, reuse=0) == {3}  # the first block of backward: 0 apart


def test_max_live_parameters_bounds_what_is_kept():
    assert _kept([0, 1, 2, 3], [3, 2, 1, 0], bucket=BIG, max_live=2 * S) == {3, 2}
    assert _kept([0, 1, 2, 3], [3, 2, 1, 0], bucket=BIG, max_live=S - 1) == set()


def test_a_block_used_only_in_backward_ends_the_kept_blocks():
    sizes = {0: S, 1: S, 2: S, 9: S}
    assert _kept([0, 1, 2], [2, 9, 1, 0], sizes=sizes, bucket=BIG) == {2}


def test_a_block_run_twice_in_forward_counts_from_its_last_use():
    # block 1 runs again after block 2: nothing runs after it in forward, so it is 0 apart from backward's start
    assert _kept([0, 1, 2, 1], [1, 2, 1, 0], bucket=0, reuse=0) == {1}
    # block 2's last use is followed by block 1 (S) in forward and block 1 (S) in backward
    assert _kept([0, 1, 2, 1], [1, 2, 1, 0], bucket=BIG, reuse=2 * S) == {1, 2}
