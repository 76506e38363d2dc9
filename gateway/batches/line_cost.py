"""What the requests of batches in flight may cost the gateway parsed, together.

A line is parsed once, by the handler its request reaches (the runner sends the line as it
is), and its parsed form costs up to ~72 bytes a JSON value whatever its text (`{}` is 3 bytes
of text and a 64-byte dict). So batch requests in flight hold, between them, at most as many
values as one request may hold (body.MAX_JSON_VALUES): lines of ordinary requests (tens of
values) run BACKGROUND_IN_FLIGHT at a time as before; lines near the bound run one at a time."""

from __future__ import annotations

import asyncio
import contextlib

from ..pipeline.body import MAX_JSON_VALUES


def line_values(raw: bytes) -> int:
    """An upper bound on the values a line holds (body.values_at_most, on the bytes), at most
    the bound: its parse refuses a line past it before building anything."""
    return min(MAX_JSON_VALUES, 1 + raw.count(b",") + raw.count(b"[") + raw.count(b"{"))


class ParsedBudget:
    """A weighted semaphore of JSON values: `hold(n)` waits until n more fit."""

    def __init__(self, capacity: int = MAX_JSON_VALUES):
        self.capacity, self.held = capacity, 0
        self._changed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def hold(self, values: int):
        values = min(values, self.capacity)
        while self.held + values > self.capacity:
            self._changed.clear()
            await self._changed.wait()
        self.held += values
        try:
            yield
        finally:
            self.held -= values
            self._changed.set()
