"""Tokens per second per model over the last hour: a small ring buffer the console draws.

Every SAMPLE_S seconds the gateway sums the `tokens_per_s` its workers report in their
heartbeat stats; each model keeps the last hour of samples (360 floats), so 50 models
hold about 18,000 numbers."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from aiohttp import web

from ..web.state import MANAGER

SAMPLE_S = 10.0
WINDOW_S = 3600.0


class Throughput:
    def __init__(self, sample_s: float = SAMPLE_S, window_s: float = WINDOW_S):
        self.sample_s = sample_s
        self.samples: dict[str, deque[tuple[float, float]]] = {}
        self._maxlen = int(window_s / sample_s)

    def sample(self, manager) -> None:
        now = round(time.time(), 1)
        for slot in list(manager.slots.values()):
            conns = manager.conns(slot)
            rate = sum(float(c.stats.get("tokens_per_s", 0) or 0) for c in conns)
            history = self.samples.get(slot.name)
            if history is None:
                if not conns:
                    continue  # never loaded: no line to draw
                history = self.samples[slot.name] = deque(maxlen=self._maxlen)
            history.append((now, round(rate, 2)))
        for name in [n for n in self.samples if n not in manager.slots]:
            del self.samples[name]  # removed from the registry

    def snapshot(self) -> dict:
        return {
            "interval_s": self.sample_s,
            "window_s": self.sample_s * self._maxlen,
            "models": {name: list(points) for name, points in self.samples.items()},
        }


THROUGHPUT = web.AppKey("throughput", Throughput)


async def throughput_lifecycle(app: web.Application):
    """A cleanup_ctx that samples while the app runs."""
    history = app[THROUGHPUT]

    async def loop() -> None:
        while True:
            history.sample(app[MANAGER])
            await asyncio.sleep(history.sample_s)

    task = asyncio.create_task(loop(), name="throughput-sampler")
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
