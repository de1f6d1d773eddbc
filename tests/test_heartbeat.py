"""The heartbeat through the torch.distributed store: a SIGSTOPped peer is named once it has been silent for
the limit; a rank that finished, or that was stopped itself and resumed, blames nobody. Real ranks, a real
store, a real SIGSTOP."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch.distributed as dist
from dist import run_distributed

from infinity.comm import start_heartbeat

LIMIT_S = 2.0


def _watch(timeout_s: float):
    """Start this rank's heartbeat; returns (the heartbeat, an Event set on silence, the messages seen)."""
    seen: list[str] = []
    fired = threading.Event()

    def on_silent(message: str) -> None:
        seen.append(message)
        fired.set()

    hb = start_heartbeat(dist.get_rank(), dist.get_world_size(), timeout_s, on_silent)
    return hb, fired, seen


def rank1_is_stopped(timeout_s: float) -> list[str]:
    """Rank 1 SIGSTOPs itself; rank 0 waits for its heartbeat to report it, then continues it and keeps
    beating a while, so that the resumed rank 1 has a live peer it must not blame."""
    pids: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    hb, fired, seen = _watch(timeout_s)
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # until rank 0 sends SIGCONT
        time.sleep(3 * timeout_s)
    else:
        fired.wait(60)
        os.kill(pids[1], signal.SIGCONT)
        time.sleep(4 * timeout_s)
    hb.stop()
    return seen


def test_a_stopped_peer_is_named_and_a_resumed_rank_blames_nobody():
    seen0, seen1 = run_distributed(rank1_is_stopped, 2, LIMIT_S, timeout_s=120)
    assert len(seen0) == 1, seen0
    assert seen0[0].startswith("rank 1 has sent no heartbeat for ")
    assert "zero_optimization.heartbeat_timeout_s, is 2 s" in seen0[0]
    assert seen1 == []  # its own stop restarted its clocks; rank 0 beat on all along


def rank1_finishes_early(timeout_s: float) -> list[str]:
    hb, _, seen = _watch(timeout_s)
    dist.barrier()
    if dist.get_rank() == 1:
        hb.stop()  # done: its silence from here on is no fault
    time.sleep(4 * timeout_s)
    hb.stop()
    return seen


def test_a_rank_that_finished_is_not_reported():
    assert run_distributed(rank1_finishes_early, 2, LIMIT_S, timeout_s=120) == [[], []]


def test_no_heartbeat_with_one_rank_or_a_zero_limit():
    assert start_heartbeat(0, 1, 60.0, print) is None
    assert start_heartbeat(0, 2, 0.0, print) is None
