"""ExecutionTrace: the recorded block order of one phase, the positions it gives while it holds, and its
invalidation at the first difference (then recorded afresh from the next pass)."""

from __future__ import annotations

import pytest

from infinity.scheduler import ExecutionTrace

pytestmark = pytest.mark.unit

NUMEL = {0: 10, 1: 200, 2: 3000, 3: 40000}


def _pass(trace: ExecutionTrace, order: list[int]) -> list[int | None]:
    """One pass visiting `order`; the position `visit` returned for each block."""
    trace.start_pass()
    positions = [trace.visit(block) for block in order]
    trace.end_pass()
    return positions


def test_the_first_pass_records_and_gives_no_positions():
    trace = ExecutionTrace()
    assert not trace.valid and trace.upcoming(0) == []
    assert _pass(trace, [0, 1, 2]) == [None, None, None]
    assert trace.valid and trace.order == [0, 1, 2] and trace.invalidations == 0


def test_a_pass_in_the_recorded_order_gets_each_blocks_position_and_what_follows():
    trace = ExecutionTrace()
    _pass(trace, [2, 0, 1])
    trace.start_pass()
    assert trace.visit(2) == 0 and trace.upcoming(0) == [0, 1]
    assert trace.visit(0) == 1 and trace.upcoming(1) == [1]
    assert trace.visit(1) == 2 and trace.upcoming(2) == []
    trace.end_pass()
    assert trace.order == [2, 0, 1] and trace.valid and trace.invalidations == 0


def test_the_first_difference_invalidates_the_trace_for_the_rest_of_the_pass():
    trace = ExecutionTrace()
    _pass(trace, [0, 1, 2, 3])
    trace.start_pass()
    assert trace.visit(0) == 0
    assert trace.visit(2) is None  # block 1 was expected
    assert trace.invalidations == 1
    assert trace.upcoming(0) == []  # nothing is prefetched from a trace that no longer holds
    assert trace.visit(3) is None  # not even where the old order would match again
    assert trace.invalidations == 1  # counted once per pass
    trace.end_pass()
    assert trace.order == [0, 2, 3] and trace.valid  # this pass is the new recording


def test_the_re_recorded_order_gives_positions_again_from_the_next_pass():
    trace = ExecutionTrace()
    for order in ([0, 1, 2, 3], [0, 2, 3]):
        _pass(trace, order)
    assert _pass(trace, [0, 2, 3]) == [0, 1, 2]
    assert trace.upcoming(0) == [2, 3] and trace.invalidations == 1
    assert _pass(trace, [0, 1, 2, 3]) == [0, None, None, None]  # back to the old order: a second invalidation
    assert trace.invalidations == 2 and trace.order == [0, 1, 2, 3]


def test_a_pass_longer_than_the_trace_invalidates_it_at_the_first_extra_block():
    trace = ExecutionTrace()
    _pass(trace, [0, 1])
    assert _pass(trace, [0, 1, 2]) == [0, 1, None]
    assert trace.invalidations == 1 and trace.order == [0, 1, 2]


def test_a_pass_that_stops_early_is_recorded_as_the_new_order():
    trace = ExecutionTrace()
    _pass(trace, [0, 1, 2])
    assert _pass(trace, [0, 1]) == [0, 1]  # every visit matched while it lasted
    assert trace.order == [0, 1] and trace.valid


def test_a_pass_without_blocks_leaves_no_trace():
    trace = ExecutionTrace()
    _pass(trace, [0, 1])
    _pass(trace, [])
    assert not trace.valid and trace.order == [] and trace.upcoming(0) == []


def test_next_use_distance_counts_the_elements_gathered_in_between():
    trace = ExecutionTrace()
    _pass(trace, [0, 1, 2, 0, 3])  # block 0 runs twice per pass
    numel_of = NUMEL.__getitem__
    assert trace.next_use_distance(0, 0, numel_of) == NUMEL[1] + NUMEL[2]
    assert trace.next_use_distance(3, 0, numel_of) is None  # its last use
    assert trace.next_use_distance(1, 1, numel_of) is None  # used once


def test_a_block_used_twice_in_a_row_is_used_again_at_distance_zero():
    trace = ExecutionTrace()
    _pass(trace, [1, 1, 2])
    assert trace.next_use_distance(0, 1, NUMEL.__getitem__) == 0


def test_next_use_distance_is_unknown_once_the_trace_no_longer_holds():
    trace = ExecutionTrace()
    _pass(trace, [0, 1, 0])
    trace.start_pass()
    trace.visit(1)  # diverges at once
    assert trace.next_use_distance(0, 0, NUMEL.__getitem__) is None


def test_after_names_the_block_the_recorded_order_runs_next_and_nothing_once_it_no_longer_holds():
    trace = ExecutionTrace()
    assert trace.after(0) is None  # nothing recorded yet
    _pass(trace, [2, 0, 1])  # a forward that runs its blocks out of definition order
    assert (trace.after(2), trace.after(0), trace.after(1), trace.after(3)) == (0, 1, None, None)
    trace.start_pass()
    trace.visit(0)  # differs from the recorded order: what follows is unknown for the rest of the pass
    assert trace.after(2) is None
