"""Side threads of a benchmark process: a VmRSS sampler that says where the peak was, a periodic gc.collect()."""

from __future__ import annotations

import gc
import sys
import threading
import time
import traceback
from pathlib import Path

from benchlib.measure import rss_bytes


class RssWatch:
    """A daemon thread sampling VmRSS every `period_s`; keeps the largest sample and where the main thread was.

    VmHWM gives the peak; this tells which phase and call reached it (the sample can miss a peak shorter
    than the period, so it reads at most VmHWM). Set `phase` from the main thread as it goes.
    """

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s = period_s
        self.max_bytes = 0
        self.where: list[str] = []
        self.phase = "start"
        self.per_phase: dict[str, int] = {}
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            rss = rss_bytes()
            phase = self.phase
            self.per_phase[phase] = max(self.per_phase.get(phase, 0), rss)
            if rss > self.max_bytes:
                self.max_bytes = rss
                frame = sys._current_frames().get(self._main)
                stack = traceback.extract_stack(frame)[-8:] if frame is not None else []
                self.where = [f"{phase}"] + [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class PeriodicGC:
    """A daemon thread calling gc.collect() every `interval_s` (0: never); counts its runs and time."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.runs = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-gc", daemon=True)
        if interval_s > 0:
            gc.freeze()  # the objects alive now (modules, torch's own) are never scanned again: collections stay cheap
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            start = time.perf_counter()
            gc.collect()
            self.seconds += time.perf_counter() - start
            self.runs += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
