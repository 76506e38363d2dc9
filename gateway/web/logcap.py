"""Rate-limited logging of repeated warnings and errors.

A flood (20,000 sockets, a storm of malformed requests, a file-descriptor shortage) makes
the same line happen thousands of times a second; written out, that is 140 MB of identical
tracebacks in 90 s, which fills the disk and hides everything else. Each kind of message
(logger, level, message template with its numbers blanked) may appear BURST times per
WINDOW_S; the rest are counted and summed up in one line when the window turns."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

BURST = 10
WINDOW_S = 10.0
_NUMBERS = re.compile(r"\d+")


@dataclass
class _Window:
    started: float
    count: int = 0


@dataclass
class RepeatLimiter:
    """Decides, per kind of message, whether this occurrence is written."""

    burst: int = BURST
    window_s: float = WINDOW_S
    _windows: dict[tuple, _Window] = field(default_factory=dict)

    def admit(self, kind: tuple) -> tuple[bool, int]:
        """(write it?, occurrences suppressed in the window that just ended)."""
        now = time.monotonic()
        w = self._windows.get(kind)
        suppressed = 0
        if w is None or now - w.started >= self.window_s:
            suppressed = max(0, w.count - self.burst) if w else 0
            if len(self._windows) > 10_000:  # never unbounded, even with endlessly new kinds
                self._windows.clear()
            w = self._windows[kind] = _Window(now)
        w.count += 1
        return w.count <= self.burst, suppressed


def message_kind(name: str, level: int, template: str) -> tuple:
    return name, level, _NUMBERS.sub("#", template[:160])


class RepeatFilter(logging.Filter):
    """A handler filter: WARNING and above are rate-limited per kind of message."""

    def __init__(self, limiter: RepeatLimiter | None = None):
        super().__init__()
        self.limiter = limiter or RepeatLimiter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        write, suppressed = self.limiter.admit(message_kind(record.name, record.levelno, str(record.msg)))
        if suppressed:
            record.msg = f"{record.msg} [{suppressed} more like this in the last {self.limiter.window_s:g} s]"
        return write


def install_log_limits(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Rate-limit repeated warnings on every root handler, and the event loop's own error
    reports (asyncio logs each failed accept(), one per connection, with a traceback)."""
    shared = RepeatLimiter()
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RepeatFilter) for f in handler.filters):
            handler.addFilter(RepeatFilter(shared))
    if loop is not None:
        loop.set_exception_handler(_loop_exception_handler(RepeatLimiter()))


def _loop_exception_handler(limiter: RepeatLimiter):
    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        kind = ("asyncio", str(context.get("message", ""))[:80], type(exc).__name__, getattr(exc, "errno", None))
        write, suppressed = limiter.admit(kind)
        if suppressed:
            log.error("%d more event-loop errors like '%s' were not logged", suppressed, kind[1])
        if write:
            loop.default_exception_handler(context)

    return handle
