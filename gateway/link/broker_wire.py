"""What the broker checks on the wire besides the frames' shapes (gateway/link/wire_checks.py):
how deep a request may nest, what an unencodable request is told, and its rate-limited
log of rejected frames."""

from __future__ import annotations

import logging
import time

from ...shared.errors import ErrorCode, ServiceError

log = logging.getLogger(__name__)

# Largest message a remote worker may send (embedding batches are the big ones).
REMOTE_MAX_MESSAGE_BYTES = 64 << 20
LOG_EVERY_S = 10.0  # rejected frames: one log line per kind per interval, with a count
# Containers inside containers in one request (HTTP bodies already stop at 64: gateway/pipeline/body.py).
MAX_WIRE_DEPTH = 256


class RateLimitedLog:
    """At most one line per kind every LOG_EVERY_S, saying how many were suppressed."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -LOG_EVERY_S) < LOG_EVERY_S:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        skipped = self._suppressed.pop(kind, 0)
        suffix = f" (and {skipped} more like it in the last {LOG_EVERY_S:g} s)" if skipped else ""
        log.warning(message + suffix, *args)


def nested_deeper_than(value, limit: int) -> bool:
    """Iteratively, so that the check itself cannot hit the recursion limit."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth >= limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list, tuple)))
    return False


def encoding_error(e: Exception) -> ServiceError:
    if isinstance(e, UnicodeError):
        why = "it holds text that is not valid Unicode (an unpaired surrogate)"
    elif isinstance(e, OverflowError):
        why = "it holds an integer outside the 64-bit range"
    elif "recursion" in str(e) or isinstance(e, RecursionError):
        why = "it is nested too deeply"
    else:
        why = "it holds a value that cannot be sent to the model worker"
    return ServiceError(ErrorCode.INVALID_REQUEST, f"the request cannot be processed: {why}")
