"""Progress of a bench level on stderr: one line redrawn in place on a terminal, a few plain
lines (every quarter of the level) otherwise, so logs and CI output stay readable."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .loadgen import RequestResult

REDRAW_S = 0.2


class LevelProgress:
    def __init__(self, title: str, total: int, stream: TextIO | None = None):
        self.title = title
        self.total = total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.done = self.failed = self.tokens = 0
        self.started = time.perf_counter()
        self._drawn = 0.0
        self._next_quarter = 1
        if not self.tty:
            self._line(f"{title}: {total} requests")

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def _status(self) -> str:
        elapsed = time.perf_counter() - self.started
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        return f"{self.title}: {self.done}/{self.total} done, {self.failed} failed, {rate:.1f} tok/s, {elapsed:.1f} s"

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += 0 if result.ok else 1
        self.tokens += result.tokens
        now = time.perf_counter()
        if self.tty:
            if now - self._drawn >= REDRAW_S or self.done == self.total:
                self._drawn = now
                bar = _bar(self.done, self.total)
                self.stream.write(f"\r\x1b[2K{bar} {self._status()}")
                self.stream.flush()
        elif self.done * 4 >= self._next_quarter * self.total:
            while self.done * 4 >= self._next_quarter * self.total:
                self._next_quarter += 1
            self._line(self._status())

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / total) if total else width
    return "[" + "#" * filled + "." * (width - filled) + "]"
