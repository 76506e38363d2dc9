"""An MCP stdio server's stderr, read from a pipe and logged with a rate limit:
handed the gateway's own stderr, a chatty or hostile tool process filled the gateway log
without bound. Each server gets LINES_PER_WINDOW lines per WINDOW_S, then one line saying
how many were dropped."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

log = logging.getLogger("mlxgw.mcp.stderr")

LINES_PER_WINDOW = 20
WINDOW_S = 10.0
MAX_LINE_CHARS = 500


class _Throttle:
    def __init__(self, label: str):
        self.label = label
        self.window_start = time.monotonic()
        self.lines = 0
        self.dropped = 0

    def line(self, text: str) -> None:
        now = time.monotonic()
        if now - self.window_start >= WINDOW_S:
            self.flush_dropped()
            self.window_start, self.lines = now, 0
        if self.lines < LINES_PER_WINDOW:
            self.lines += 1
            log.info("MCP server %r stderr: %s", self.label, text[:MAX_LINE_CHARS])
        else:
            self.dropped += 1

    def flush_dropped(self) -> None:
        if self.dropped:
            log.warning("MCP server %r: %d stderr lines not logged (rate limit)", self.label, self.dropped)
            self.dropped = 0


def _pump(read_fd: int, throttle: _Throttle) -> None:
    with open(read_fd, encoding="utf-8", errors="replace") as pipe:
        for raw in pipe:
            throttle.line(raw.rstrip("\n"))
    throttle.flush_dropped()


@contextmanager
def throttled_stderr(label: str) -> Iterator[TextIO]:
    """A file to give the process as its stderr; its lines reach the log throttled."""
    read_fd, write_fd = os.pipe()
    threading.Thread(target=_pump, args=(read_fd, _Throttle(label)), name=f"mcp-stderr-{label}", daemon=True).start()
    errlog = open(write_fd, "w", encoding="utf-8")  # noqa: SIM115 (closed below, after the process is gone)
    try:
        yield errlog
    finally:
        errlog.close()  # the reader sees the end once the process's copy is closed too
