"""Block files of the disk tier read off the engine thread.

A prompt whose prefix lies on disk (worker/model/cache/block_disk.py) would otherwise have
its block files read by the engine thread at admission, and every running row would wait
for the disk (a second per 50k tokens at SSD speed, much longer on a busy or slow disk).
Instead, once the prompt is known (queued, and again at each admission try), its blocks'
files are read here into memory by one reader thread, the row waits in the queue while the
other rows keep stepping, and it is admitted when every read has ended. The engine thread
then only makes arrays of bytes already read, parsed and checked here (`check`: the block
file's header parsed and its digest verified, worker/model/cache/block_bytes.py). No MLX call
is made here.

A read that fails, or is still pending after READ_TIMEOUT_S (a hung disk or a file that
never ends), counts as failed: the block is skipped and the row computes what it missed."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .block_file import read_regular

READ_TIMEOUT_S = 30.0  # past it a read counts as failed: the row computes instead of waiting on
UNCLAIMED_S = 120.0  # bytes read for a row that never came (cancelled) are dropped after this


class ReadFailed(Exception):
    """A block file could not be read in time: its block is skipped."""


@dataclass
class _Read:
    future: Future
    started: float


class BlockReader:
    def __init__(self, check: Callable[[bytes], Any] = bytes, timeout_s: float = READ_TIMEOUT_S):
        """check: what this thread makes of a file's bytes (what take returns); an exception
        it raises is a failed read."""
        self.check = check
        self.timeout_s = timeout_s
        self._queue: queue.SimpleQueue[tuple[Future, Path, int | None]] = queue.SimpleQueue()
        # A daemon thread, not an executor's: a read stuck on a hung disk must not hold up
        # the worker's exit (executor threads are joined at exit).
        threading.Thread(target=self._serve, name="prefix-block-read", daemon=True).start()
        self._reads: dict[bytes, _Read] = {}  # touched by the engine thread only
        self.counts = {"prefetched": 0, "failed": 0}

    def start(self, key: bytes, path: Path, size: int | None = None) -> None:
        """Begin reading a block's file unless a read of it is under way or done (size: the
        bytes it was indexed with; a link, a non-regular file or another size fails)."""
        now = time.monotonic()
        self._expire(now)
        if key not in self._reads:
            future: Future = Future()
            self._queue.put((future, path, size))
            self._reads[key] = _Read(future, now)

    def ended(self, key: bytes) -> bool:
        """Whether the block's read has ended (read, failed or timed out); True when none began."""
        read = self._reads.get(key)
        return read is None or read.future.done() or time.monotonic() - read.started > self.timeout_s

    def take(self, key: bytes) -> Any:
        """check(the block file's bytes) when its read ended well; None when no read of it began
        (the caller reads the file itself). Raises ReadFailed for a failed or hung read."""
        read = self._reads.get(key)
        if read is None:
            return None
        if not read.future.done():
            if time.monotonic() - read.started <= self.timeout_s:
                return None  # not asked for ahead of admission in time: read by the caller
            self._reads.pop(key)
            self.counts["failed"] += 1
            raise ReadFailed(f"no bytes after {self.timeout_s:g} s")
        self._reads.pop(key)
        error = read.future.exception()
        if error is not None:
            self.counts["failed"] += 1
            raise ReadFailed(str(error)) from error
        self.counts["prefetched"] += 1
        return read.future.result()

    def _serve(self) -> None:
        while True:
            future, path, size = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.check(read_regular(path, size)))
            except Exception as e:  # the engine thread reads it as a failed read
                future.set_exception(e)

    def forget(self, key: bytes) -> None:
        self._reads.pop(key, None)

    def _expire(self, now: float) -> None:
        for key in [k for k, r in self._reads.items() if r.future.done() and now - r.started > UNCLAIMED_S]:
            del self._reads[key]

    @property
    def pending(self) -> int:
        return sum(1 for r in self._reads.values() if not r.future.done())
