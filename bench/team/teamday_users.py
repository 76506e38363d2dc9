"""The simulated users of bench/team/teamday.py: one API key each, a shape of traffic each
(a flooder, one request at a time, an agent's bursts on a long shared system prompt, an
embedding job, a Files + Batch API job), and what each got (UserStats)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

from ..loadgen import WORDS, one_request


@dataclass
class UserStats:
    name: str
    kind: str
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    ok: int = 0
    refused: int = 0  # 429/503: explicit, nothing lost
    errors: int = 0  # anything else: lost
    started: float = field(default_factory=time.perf_counter)

    def add(self, r) -> None:
        if r.ok:
            self.ok += 1
            self.tokens += r.tokens
            if r.ttft is not None:
                self.ttft_seen(r.ttft)
        elif r.status in (429, 503):
            self.refused += 1
        else:
            self.errors += 1

    def ttft_seen(self, ttft: float) -> None:
        self.ttfts.append(ttft)

    def row(self, seconds: float, idle_ttft: float | None = None) -> dict:
        return {
            "user": self.name,
            "kind": self.kind,
            "requests": self.ok,
            "refused": self.refused,
            "errors": self.errors,
            "ttft_p50_s": pct(self.ttfts, 50),
            "ttft_p99_s": pct(self.ttfts, 99),
            "idle_ttft_s": idle_ttft,
            "p99_vs_idle": ratio(pct(self.ttfts, 99), idle_ttft),
            "tok_s": round(self.tokens / seconds, 1),
        }


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))], 3)


def jain(values: list[float]) -> float | None:
    """Jain's index: 1 when every user gets the same, 1/n when one gets everything."""
    values = [v for v in values if v]
    if not values:
        return None
    return round(sum(values) ** 2 / (len(values) * sum(v * v for v in values)), 3)


def key_of(name: str) -> str:
    return f"mlxgw-bench-{name}-" + hashlib.sha256(name.encode()).hexdigest()[:16]


def session_for(user: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {key_of(user)}"}, timeout=aiohttp.ClientTimeout(total=600)
    )


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# The served model's name: "chat" on mlxgw, the model folder on a peer (set per mode by main).
SERVED = {"model": "chat"}


async def chat(session, url: str, messages: list[dict], max_tokens: int):
    model = SERVED["model"]
    return await one_request(session, url, model, messages, max_tokens=max_tokens, temperature=0.7, stream=True)


# -- users ---------------------------------------------------------------------------------------
async def flooder(url: str, stats: UserStats, streams: int, until: float, max_tokens: int) -> None:
    rng = random.Random(stats.name)

    async def loop(session) -> None:
        while time.perf_counter() < until:
            stats.add(await chat(session, url, [{"role": "user", "content": words(rng, 20)}], max_tokens))

    async with session_for(stats.name) as session:
        await asyncio.gather(*(loop(session) for _ in range(streams)))


async def one_at_a_time(url: str, stats: UserStats, until: float, max_tokens: int, think_s: float = 0.0) -> None:
    rng = random.Random(stats.name)
    async with session_for(stats.name) as session:
        while time.perf_counter() < until:
            stats.add(await chat(session, url, [{"role": "user", "content": words(rng, 12)}], max_tokens))
            if think_s:
                await asyncio.sleep(rng.uniform(0.5 * think_s, 1.5 * think_s))


async def agent(url: str, stats: UserStats, until: float, system: str, burst: int, max_tokens: int) -> None:
    """Tool loops: each turn a burst of parallel requests on a long shared system prompt."""
    rng = random.Random(stats.name)
    async with session_for(stats.name) as session:
        while time.perf_counter() < until:
            history = [{"role": "system", "content": system}, {"role": "user", "content": words(rng, 15)}]
            for _turn in range(3):
                results = await asyncio.gather(*(chat(session, url, history, max_tokens) for _ in range(burst)))
                for r in results:
                    stats.add(r)
                history = [*history, {"role": "assistant", "content": "calling a tool"}]
                history.append({"role": "user", "content": f"tool result: {words(rng, 10)}"})
                if time.perf_counter() >= until:
                    break


async def embedder(url: str, stats: UserStats, until: float) -> None:
    rng = random.Random(stats.name)
    async with session_for(stats.name) as session:
        while time.perf_counter() < until:
            body = {"model": "embed", "input": [words(rng, 30) for _ in range(16)]}
            started = time.perf_counter()
            async with session.post(f"{url}/embeddings", json=body) as r:
                await r.read()
                if r.status == 200:
                    stats.ok += 1
                    stats.ttft_seen(time.perf_counter() - started)
                elif r.status in (429, 503):
                    stats.refused += 1
                else:
                    stats.errors += 1
                    await asyncio.sleep(0.5)  # a broken setup must not spin


async def batch_job(url: str, stats: UserStats, n: int, max_tokens: int) -> dict:
    """A Files + Batch API job of n chat requests; its wall time and what it answered."""
    rng = random.Random(stats.name)
    lines = [
        {
            "custom_id": f"job-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "chat",
                "messages": [{"role": "user", "content": words(rng, 12)}],
                "max_tokens": max_tokens,
            },
        }
        for i in range(n)
    ]
    started = time.perf_counter()
    async with session_for(stats.name) as session:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode()), filename="job.jsonl")
        async with session.post(f"{url}/files", data=form) as r:
            file_id = (await r.json())["id"]
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        async with session.post(f"{url}/batches", json=body) as r:
            batch_id = (await r.json())["id"]
        batch: dict = {}
        for _ in range(3600):
            async with session.get(f"{url}/batches/{batch_id}") as r:
                batch = await r.json()
            if batch["status"] in ("completed", "failed", "cancelled", "expired"):
                break
            await asyncio.sleep(0.2)
    counts = batch.get("request_counts", {})
    stats.ok, stats.errors = counts.get("completed", 0), counts.get("failed", 0)
    return {"status": batch.get("status"), "seconds": round(time.perf_counter() - started, 1), **counts}


def ratio(x, y) -> float | None:
    return round(x / y, 2) if x and y else None
