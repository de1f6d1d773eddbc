"""A heartbeat through the torch.distributed store: a stopped or hung peer ends the run after `timeout_s`,
long before a collective's own timeout (`comm_timeout_s`, 600 s by default) would.

Each rank runs two daemon threads on its own client of the process group's store (a clone, so the
group's connection is never queued behind a heartbeat):
- the beat: every `interval_s`, adds 1 to `infinity/heartbeat/<rank>` and reads every peer's counter;
- the watch: a peer whose counter has not moved for `timeout_s`, and that has not said it finished, is
  silent (SIGSTOPped, hung with the GIL held, its host gone): `on_silent(message)` is called once.
A rank whose own threads were held up (it was stopped itself, or starved) judges nobody that round and
restarts its clocks. A store that does not answer for `timeout_s` is reported the same way. A dead
peer is usually noticed sooner by the collectives themselves (a closed connection).
Traffic: world_size small store requests per rank per `interval_s`.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from infinity.comm.collectives import CommError

_BEAT_KEY = "infinity/heartbeat/{rank}"
_FINISHED_KEY = "infinity/heartbeat/{rank}/finished"
MAX_INTERVAL_S = 5.0


class PeerSilentError(CommError):
    """A peer rank stopped sending heartbeats (or the store stopped answering) for longer than the limit."""


def default_interval_s(timeout_s: float) -> float:
    """How often to beat and look: a quarter of the limit, at most MAX_INTERVAL_S."""
    return max(0.05, min(MAX_INTERVAL_S, timeout_s / 4))


class Heartbeat:
    """This rank's beat and its watch over every peer; `start()` it, `stop()` it when the rank is done.

    `store` must be a client of the process group's store that nothing else blocks on (see
    `start_heartbeat`); `on_silent(message)` runs in the watch thread, once, when a peer or the store
    falls silent for more than `timeout_s` seconds.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout_s: float,
        on_silent: Callable[[str], None],
        interval_s: float | None = None,
        limit_name: str = "zero_optimization.heartbeat_timeout_s",
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s is {timeout_s}; it must be > 0")
        self.store = store
        self.rank = rank
        self.timeout_s = timeout_s
        self.interval_s = interval_s if interval_s is not None else default_interval_s(timeout_s)
        self.on_silent = on_silent
        self.limit_name = limit_name
        self.peers = [r for r in range(world_size) if r != rank]
        self.silence: str | None = None  # the message, once a peer or the store fell silent
        self._lock = threading.Lock()
        self._stop = threading.Event()
        now = time.monotonic()
        self._seen: dict[int, tuple[int, float]] = {p: (-1, now) for p in self.peers}  # counter, when it moved
        self._finished: set[int] = set()
        self._op_since: float | None = None  # a store request in flight since then
        self._last_error: Exception | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> Heartbeat:
        now = time.monotonic()
        with self._lock:
            self._seen = {p: (-1, now) for p in self.peers}
        for target, name in ((self._beat_loop, "beat"), (self._watch_loop, "watch")):
            thread = threading.Thread(target=target, name=f"infinity-heartbeat-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop beating and watching, and tell the peers this rank finished (so its silence is no fault)."""
        self._stop.set()
        beat = self._threads[0] if self._threads else None
        if beat is not None and beat is not threading.current_thread():
            beat.join(self.interval_s + 2.0)  # a store that no longer answers must not hold the exit

    # -- the beat ------------------------------------------------------------------------------------

    def _beat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._beat_once()
            except Exception as exc:  # the store refused; the watch reports it if it lasts
                with self._lock:
                    self._op_since, self._last_error = None, exc
            self._stop.wait(self.interval_s)
        try:
            self.store.set(_FINISHED_KEY.format(rank=self.rank), "1")
        except Exception:
            pass  # the peers will see a closed connection instead

    def _beat_once(self) -> None:
        with self._lock:
            self._op_since = time.monotonic()
        self.store.add(_BEAT_KEY.format(rank=self.rank), 1)
        counters = {p: self.store.add(_BEAT_KEY.format(rank=p), 0) for p in self.peers}  # add 0: read, never block
        finished = {p for p in self.peers if self.store.check([_FINISHED_KEY.format(rank=p)])}
        now = time.monotonic()
        with self._lock:
            self._op_since, self._last_error = None, None
            for peer, counter in counters.items():
                if counter != self._seen[peer][0]:
                    self._seen[peer] = (counter, now)
            self._finished |= finished

    # -- the watch -----------------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            held_up = now - last > 2 * self.interval_s + 1.0
            last = now
            with self._lock:
                if held_up:  # this process was stopped or starved: no peer's fault, restart the clocks
                    self._seen = {p: (counter, now) for p, (counter, _) in self._seen.items()}
                    self._op_since = now if self._op_since is not None else None
                    continue
                message = self._judge(now)
            if message:
                self.silence = message
                self.on_silent(message)
                return

    def _judge(self, now: float) -> str:
        limit = f"the limit, {self.limit_name}, is {self.timeout_s:g} s"
        if self._op_since is not None and now - self._op_since > self.timeout_s:
            return (
                f"the torch.distributed store at {_store_address()} has not answered for {now - self._op_since:.0f} s "
                f"({limit}): its host (rank 0's, without torchrun) is stopped or unreachable; ending the run"
            )
        silent = [
            (now - moved, peer)
            for peer, (_, moved) in self._seen.items()
            if peer not in self._finished and now - moved > self.timeout_s
        ]
        if silent:
            quiet_s, peer = max(silent)
            store_note = f" (the store also failed: {self._last_error})" if self._last_error is not None else ""
            return (
                f"rank {peer} has sent no heartbeat for {quiet_s:.0f} s ({limit}): it is stopped, hung or its "
                f"host is unreachable{store_note}; ending the run: check rank {peer}'s process and host"
            )
        return ""


def _store_address() -> str:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{host}:{port}" if host and port else "MASTER_ADDR:MASTER_PORT"


def start_heartbeat(
    rank: int, world_size: int, timeout_s: float, on_silent: Callable[[str], None], interval_s: float | None = None
) -> Heartbeat | None:
    """Start this rank's heartbeat on the default process group's store; None when there is nothing to
    watch (one rank, no process group), `timeout_s` is 0 (off), or one is running already."""
    global _running
    if timeout_s <= 0 or world_size < 2 or not dist.is_initialized():
        return None
    if _running is not None and not _running._stop.is_set():
        return None  # one heartbeat a process: the caller that started it (the command) owns it
    from torch.distributed.distributed_c10d import _get_default_store  # no public accessor for the group's store

    store = _get_default_store().clone()  # its own connection: never queued behind the group's requests
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    _running = Heartbeat(store, rank, world_size, timeout_s, on_silent, interval_s).start()
    return _running


_running: Heartbeat | None = None


def end_on_silence(message: str) -> None:
    """A library run's `on_silent`: say what fell silent on stderr and end the process (exit code 7)."""
    from infinity.comm.abort import end_process

    end_process(7, lambda: print(f"infinity: {message}", file=sys.stderr, flush=True))
