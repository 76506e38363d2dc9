"""The client of the gateway-overhead benches: a closed loop of keep-alive connections that
counts answered requests and streamed tokens cheaply (it shares the cores with the servers),
and the CPU time a server's processes spent, which a busy machine does not change."""

from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import dataclass

import aiohttp

MODEL = "null"  # the null-engine model every overhead bench serves
_USAGE_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes so far (a busy machine slows a server down,
    but does not change how much CPU it spends per request)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def pin(pids: list[int], cpu: int) -> None:
    for pid in pids:
        try:
            os.sched_setaffinity(pid, {cpu})
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class Tally:
    requests: int = 0
    tokens: int = 0
    failed: int = 0


async def one(session: aiohttp.ClientSession, url: str, body: dict, tally: Tally) -> None:
    async with session.post(url, json=body) as resp:
        data = await resp.read()
    if resp.status != 200:
        tally.failed += 1
        return
    # Cheap on the client (it shares the cores): the usage's count, and for a stream the
    # content chunks, found without parsing every chunk.
    usage = _USAGE_TOKENS.search(data)
    tokens = int(usage.group(1)) if usage else 0
    if body["stream"]:
        chunks = data.count(b'"delta":{"content":"')
        if chunks != tokens or not data.endswith(b"data: [DONE]\n\n"):
            tally.failed += 1
            return
    tally.requests += 1
    tally.tokens += tokens


async def drive(url: str, concurrency: int, seconds: float, max_tokens: int, stream: bool) -> tuple[Tally, float]:
    """Closed loop: each of `concurrency` clients sends its next request as the last one ends."""
    tally = Tally()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a short story about a lantern."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        end = time.perf_counter() + seconds
        target = f"{url}/v1/chat/completions"

        async def client() -> None:
            while time.perf_counter() < end:
                await one(session, target, body, tally)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return tally, wall
