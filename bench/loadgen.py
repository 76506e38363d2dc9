"""Closed-loop load against any OpenAI-compatible base URL.

Each of `concurrency` clients sends its next request as soon as the previous one ends.
Streaming requests record time to first token and the gaps between content chunks
(inter-token latency when stream_interval is 1)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

WORDS = """river mountain signal quiet amber engine harbor lantern velvet orbit meadow cipher
granite willow pepper falcon copper thunder pillow saddle marble glacier violet canvas ember
fossil jungle kettle ladder magnet nectar oyster prism quartz rocket saffron tundra umbrella
vortex walnut yonder zephyr""".split()


@dataclass
class RequestResult:
    ok: bool
    status: int
    error: str | None = None
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    cached_tokens: int = 0
    e2e: float = 0.0
    index: int = -1  # the prompt's place in the level's list (results arrive in finishing order)
    text: str = ""  # the streamed content, kept to compare outputs (greedy parity)


def varied_prompts(n: int, words: int, seed: int = 0, max_words: int | None = None) -> list[list[dict]]:
    """Distinct prompts of `words` words (or a length drawn uniformly up to `max_words`):
    a fixed prompt mostly measures a peer's prompt cache."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(words, max_words) if max_words and max_words > words else words
        body = " ".join(rng.choice(WORDS) for _ in range(length))
        out.append([{"role": "user", "content": f"Note {i}: {body}. Write a short story about these words."}])
    return out


def shared_prefix_prompts(n: int, prefix_words: int, seed: int = 0) -> list[list[dict]]:
    """One long common system prompt (an agent's tools and instructions) + a new question."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_words))
    return [
        [
            {"role": "system", "content": f"Reference material: {prefix}"},
            {"role": "user", "content": f"Question {i}: which word comes first in the material?"},
        ]
        for i in range(n)
    ]


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, result: RequestResult, started: float) -> None:
    last = None
    async with session.post(url, json=body) as resp:
        result.status = resp.status
        if resp.status != 200:
            result.error = (await resp.text())[:200]
            return
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.error = chunk["error"].get("message", "error event")
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
                result.tokens = usage.get("completion_tokens", result.tokens)
                result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            choices = chunk.get("choices") or []
            content = (choices[0].get("delta") or {}).get("content") if choices else None
            if content:
                result.text += content
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - started
                else:
                    result.gaps.append(now - last)
                last = now
        result.ok = result.error is None


async def _plain(session: aiohttp.ClientSession, url: str, body: dict, result: RequestResult) -> None:
    async with session.post(url, json=body) as resp:
        result.status = resp.status
        payload = await resp.json(content_type=None)
        if resp.status != 200:
            result.error = str(payload)[:200]
            return
        usage = payload.get("usage") or {}
        choices = payload.get("choices") or []
        result.text = ((choices[0].get("message") or {}).get("content") or "") if choices else ""
        result.tokens = usage.get("completion_tokens", 0)
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        result.ok = True


async def one_request(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    messages: list[dict],
    *,
    max_tokens: int,
    temperature: float,
    stream: bool,
    extra: dict | None = None,  # more body fields (mlx_lm.server's per-request `adapters`)
) -> RequestResult:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": stream,
        **(extra or {}),
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    result = RequestResult(ok=False, status=0)
    started = time.perf_counter()
    url = f"{base_url.rstrip('/')}/chat/completions"
    try:
        if stream:
            await _stream(session, url, body, result, started)
        else:
            await _plain(session, url, body, result)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    result.e2e = time.perf_counter() - started
    return result


async def run_level(
    base_url: str,
    model: str,
    prompts: list[list[dict]],
    concurrency: int,
    *,
    max_tokens: int,
    temperature: float,
    stream: bool = True,
    timeout_s: float = 600,
    api_key: str | None = None,
    on_result: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every prompt once with `concurrency` clients; return results and wall time.
    on_result sees each request as it ends (progress)."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, p in enumerate(prompts):
        queue.put_nowait((i, p))
    results: list[RequestResult] = []
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:

        async def client() -> None:
            while not queue.empty():
                index, messages = queue.get_nowait()
                result = await one_request(
                    session,
                    base_url,
                    model,
                    messages,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    stream=stream,
                )
                result.index = index
                results.append(result)
                if on_result is not None:
                    on_result(result)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return results, wall
