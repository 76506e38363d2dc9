"""A process's peak resident memory while a block runs."""

from __future__ import annotations

import threading
import time

import psutil


class PeakRss:
    """Sampled every 20 ms: `base` at entry, `peak` over the block, `growth` the difference."""

    def __init__(self, pid: int):
        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()

    def __enter__(self):
        self.base = self.peak = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.02)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.base
