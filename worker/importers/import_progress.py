"""Progress of `mlxgw models import` on stderr, phase by phase (hashing, reading tensors,
strict load check, materialising, writing): one bar redrawn in place on a terminal, plain
lines otherwise (a phase's start, each quarter, its end), so logs and CI output stay
readable and stdout keeps only the result line scripts read. Same approach as
bench/progress.py."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

REDRAW_S = 0.2
POLL_S = 0.2


def _amount(n: float, unit: str) -> str:
    if unit != "MB":
        return f"{int(n)}"
    return f"{n / 1e6:.1f}" if n < 10e6 else f"{n / 1e6:.0f}"


def _bar(done: float, total: float, width: int = 24) -> str:
    filled = min(width, int(width * done / total)) if total else width
    return "[" + "#" * filled + "." * (width - filled) + "]"


class ImportProgress:
    """Phases run one after another; `start` opens one, `advance` counts toward its total
    (bytes when unit is "MB", else items), `end` closes it. A total of 0: a step with no
    measure (the strict load check), shown as started and done."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.title = ""
        self.unit = ""
        self.total = 0.0
        self.done = 0.0
        self.started = 0.0
        self._drawn = 0.0
        self._next_quarter = 1
        self._lock = threading.Lock()  # the folder watcher advances from its own thread

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def _status(self) -> str:
        elapsed = time.perf_counter() - self.started
        if not self.total:
            return f"{self.title}, {elapsed:.1f} s"
        pct = 100 * self.done / self.total
        return (
            f"{self.title}: {_amount(self.done, self.unit)}/{_amount(self.total, self.unit)} {self.unit}"
            f" ({int(pct)}%), {elapsed:.1f} s"
        )

    def start(self, title: str, total: float = 0, unit: str = "") -> None:
        with self._lock:
            self.title, self.total, self.unit, self.done = title, float(total), unit, 0.0
            self.started = self._drawn = time.perf_counter()
            self._next_quarter = 1
            if self.tty:
                self._redraw()
            else:
                self._line(f"{title}: {_amount(total, unit)} {unit}".rstrip() if total else f"{title} ...")

    def advance(self, amount: float = 1) -> None:
        with self._lock:
            self.done = min(self.done + amount, self.total) if self.total else self.done
            self._show()

    def set(self, done: float) -> None:
        with self._lock:
            self.done = min(done, self.total)
            self._show()

    def _show(self) -> None:
        if not self.total:
            return
        if self.tty:
            if time.perf_counter() - self._drawn >= REDRAW_S:
                self._redraw()
        elif self.done * 4 >= self._next_quarter * self.total and self.done < self.total:
            while self.done * 4 >= self._next_quarter * self.total:
                self._next_quarter += 1
            self._line(self._status())

    def _redraw(self) -> None:
        self._drawn = time.perf_counter()
        bar = _bar(self.done, self.total) + " " if self.total else ""
        self.stream.write(f"\r\x1b[2K{bar}{self._status()}")
        self.stream.flush()

    def end(self) -> None:
        with self._lock:
            self.done = self.total
            if self.tty:
                self._redraw()
                self.stream.write("\n")
                self.stream.flush()
            else:
                self._line(
                    f"{self._status()} done"
                    if self.total
                    else f"{self.title}: done, {time.perf_counter() - self.started:.1f} s"
                )

    @contextmanager
    def phase(self, title: str, total: float = 0, unit: str = "") -> Iterator[ImportProgress]:
        self.start(title, total, unit)
        try:
            yield self
        except BaseException:
            self._abandon()
            raise
        self.end()

    def _abandon(self) -> None:
        """A phase that failed: end the redrawn line, so the error starts on its own."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    @contextmanager
    def watch_folder(self, title: str, folder: Path, total: int) -> Iterator[None]:
        """Bytes written into `folder` (polled from a thread) while the body writes it."""
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(POLL_S):
                self.set(_folder_bytes(folder))

        self.start(title, total, "MB")
        watcher = threading.Thread(target=poll, name="import-progress", daemon=True)
        watcher.start()
        try:
            yield
        except BaseException:
            self._abandon()
            raise
        finally:
            stop.set()
            watcher.join()
        self.end()


class NoProgress(ImportProgress):
    """What the importers use when nobody watches (tests, library calls): prints nothing."""

    def __init__(self) -> None:
        super().__init__(stream=sys.stderr)
        self.tty = False

    def _line(self, text: str) -> None:
        pass

    @contextmanager
    def watch_folder(self, title: str, folder: Path, total: int) -> Iterator[None]:
        yield  # nobody watches: no polling thread


def _folder_bytes(folder: Path) -> int:
    total = 0
    for f in folder.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:
            pass  # a file renamed or removed under us
    return total
