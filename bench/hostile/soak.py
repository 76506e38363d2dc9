"""Soak: a server process's RSS sampled every second through a long mixed load.

    python -m mlxgw.bench.hostile.soak --url http://127.0.0.1:8000 --model smollm2-135m --minutes 30
    python -m mlxgw.bench.hostile.soak --url http://127.0.0.1:8200 --model PATH --pid PID --label mlx_lm.server

The load mixes what a team's server sees, drawn at random per request (seeded): distinct
prompts of varied length, agent-style requests sharing one of a few long system prompts,
multi-turn continuations, streams the client cuts (some mid-prefill, some mid-answer),
n > 1 choices, and max_tokens from 8 to 128. `concurrency` closed-loop clients.

The process watched is the model's worker (found through mlxgw's /v1/status) or --pid for
a peer. Reported: RSS when warm-up ends, at the end, its maximum and its growth after
warm-up, plus (mlxgw) the prefix cache's configured bound and the MLX counters. The goal:
flat after warm-up, within the model's footprint + cache bound + live KV."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

from ..loadgen import WORDS
from ..stats import percentile

KINDS = ("varied", "shared_prefix", "multi_turn", "cancel_prefill", "cancel_answer", "choices")
WEIGHTS = (30, 25, 15, 10, 10, 10)


@dataclass
class SoakConfig:
    url: str  # server root, without /v1
    model: str
    minutes: float
    concurrency: int = 8
    warmup_minutes: float = 1.0
    seed: int = 0
    prefixes: int = 4  # distinct long system prompts
    prefix_words: int = 600
    n_choices: bool = True  # peers without n > 1 answer only the first choice (counted, not failed)


@dataclass
class Sample:
    t: float
    rss: int
    mlx_active: int | None = None
    cache_bytes: int | None = None
    cache_entries: int | None = None


@dataclass
class Tally:
    sent: Counter = field(default_factory=Counter)
    failed: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Workload:
    """One request body per draw; deterministic for a seed."""

    def __init__(self, cfg: SoakConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        prefix_rng = random.Random(cfg.seed + 1)
        self.prefixes = [_words(prefix_rng, cfg.prefix_words) for _ in range(cfg.prefixes)]
        self.count = 0

    def draw(self) -> tuple[str, dict, int | None]:
        """(kind, body, cut after this many content chunks or None)."""
        rng, self.count = self.rng, self.count + 1
        kind = rng.choices(KINDS, WEIGHTS)[0]
        max_tokens = rng.choice((8, 16, 32, 64, 128))
        note = f"Note {self.count}: "
        if kind == "shared_prefix" or kind == "cancel_prefill":
            system = f"Reference material: {rng.choice(self.prefixes)}"
            messages = [{"role": "system", "content": system}, {"role": "user", "content": note + _words(rng, 12)}]
            if kind == "cancel_prefill":  # a fresh long prompt, cut before its first token
                messages[0]["content"] = f"Reference material: {_words(rng, self.cfg.prefix_words * 2)}"
        elif kind == "multi_turn":
            messages = [
                {"role": "user", "content": note + _words(rng, rng.randint(20, 200))},
                {"role": "assistant", "content": _words(rng, rng.randint(20, 120))},
                {"role": "user", "content": "Go on: " + _words(rng, 10)},
            ]
        else:
            messages = [{"role": "user", "content": note + _words(rng, rng.randint(10, 400))}]
        body = {"model": self.cfg.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.7}
        if kind == "choices" and self.cfg.n_choices:
            body["n"] = rng.choice((2, 3))
        body["stream"] = kind != "choices"
        cut = {"cancel_prefill": 0, "cancel_answer": rng.randint(1, 6)}.get(kind)
        return kind, body, cut


async def _send(session: aiohttp.ClientSession, url: str, body: dict, cut: int | None) -> str | None:
    """None when the request went as planned, else an error text."""
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return f"HTTP {resp.status}: {(await resp.text())[:120]}"
        if not body["stream"]:
            await resp.read()
            return None
        chunks = 0
        if cut == 0:  # cut mid-prefill: leave after the preamble, or after a short wait
            try:
                await asyncio.wait_for(resp.content.readline(), 0.5)
            except asyncio.TimeoutError:
                pass
            resp.close()
            return None
        async for raw in resp.content:
            if raw.startswith(b"data: ") and b'"content"' in raw:
                chunks += 1
                if cut is not None and chunks >= cut:
                    resp.close()  # the client goes away: the server must cancel
                    return None
        return None


async def _client(cfg: SoakConfig, work: Workload, tally: Tally, stop_at: float) -> None:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < stop_at:
            kind, body, cut = work.draw()
            tally.sent[kind] += 1
            try:
                error = await _send(session, cfg.url, body, cut)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                error = f"{type(e).__name__}: {e}"
            if error:
                tally.failed[kind] += 1
                tally.errors[error[:80]] += 1


async def _status(session: aiohttp.ClientSession, url: str, model: str) -> dict | None:
    """mlxgw's worker stats for the model (None for a peer without /v1/status)."""
    try:
        async with session.get(f"{url}/v1/status") as resp:
            if resp.status != 200:
                return None
            data = await resp.json()
    except (aiohttp.ClientError, ValueError):
        return None
    for m in data.get("models") or []:
        if m.get("name") == model:
            ready = [w for w in m.get("workers") or [] if w.get("state") == "ready"]
            return ready[0] if ready else None
    return None


async def _sampler(cfg: SoakConfig, proc: psutil.Process, samples: list[Sample], stop_at: float) -> None:
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < stop_at:
            sample = Sample(round(time.monotonic() - started, 1), proc.memory_info().rss)
            worker = await _status(session, cfg.url, cfg.model)
            stats = (worker or {}).get("stats") or {}
            if stats:
                sample.mlx_active = stats.get("mlx_active_bytes")
                cache = stats.get("cache") or {}
                sample.cache_bytes, sample.cache_entries = cache.get("bytes"), cache.get("entries")
            samples.append(sample)
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started - sample.t)))


async def find_worker_pid(url: str, model: str, timeout: float = 120) -> int:
    """Load the model (one request) and return its worker's pid from /v1/status."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            await resp.read()
        worker = await _status(session, url, model)
    if not worker or not worker.get("pid"):
        raise SystemExit(f"no ready worker for {model} at {url}; pass --pid")
    return int(worker["pid"])


async def soak(cfg: SoakConfig, pid: int) -> dict:
    proc = psutil.Process(pid)
    samples: list[Sample] = []
    tally = Tally()
    work = Workload(cfg)
    stop_at = time.monotonic() + cfg.minutes * 60
    async with aiohttp.ClientSession() as session:
        first = await _status(session, cfg.url, cfg.model)
    await asyncio.gather(
        _sampler(cfg, proc, samples, stop_at), *(_client(cfg, work, tally, stop_at) for _ in range(cfg.concurrency))
    )
    return summarize(cfg, samples, tally, first)


def summarize(cfg: SoakConfig, samples: list[Sample], tally: Tally, first: dict | None) -> dict:
    warm = [s for s in samples if s.t >= cfg.warmup_minutes * 60] or samples
    rss_warm = [s.rss for s in warm]
    cache = ((first or {}).get("stats") or {}).get("cache") or {}
    mb = 1 << 20

    def _mb(x):
        return round(x / mb, 1) if x is not None else None

    tail = rss_warm[-max(1, len(rss_warm) // 10) :]  # the last tenth, against noise
    head = rss_warm[: max(1, len(rss_warm) // 10)]
    return {
        "config": cfg.__dict__,
        "requests": dict(tally.sent),
        "failed": dict(tally.failed),
        "errors": dict(tally.errors.most_common(5)),
        "rss_start_mb": _mb(samples[0].rss) if samples else None,
        "rss_after_warmup_mb": _mb(percentile(head, 50)),
        "rss_end_mb": _mb(percentile(tail, 50)),
        "rss_max_mb": _mb(max(s.rss for s in samples)) if samples else None,
        "rss_growth_after_warmup_mb": _mb(percentile(tail, 50) - percentile(head, 50)) if samples else None,
        "cache_bound_mb": _mb(cache.get("max_bytes")),
        "cache_max_mb": _mb(max((s.cache_bytes or 0) for s in samples)) if samples else None,
        "mlx_active_max_mb": _mb(max((s.mlx_active or 0) for s in samples)) if samples else None,
        "mlx_active_end_mb": _mb(samples[-1].mlx_active) if samples and samples[-1].mlx_active else None,
        "samples": [s.__dict__ for s in samples],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--warmup-minutes", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--pid", type=int, default=None, help="process to watch (default: mlxgw's worker for --model)")
    ap.add_argument("--label", default="mlxgw")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-choices", action="store_true", help="never send n > 1")
    ap.add_argument("--out", type=Path, default=None, help="write the report (with every sample) as JSON")
    args = ap.parse_args(argv)
    url = args.url.rstrip("/").removesuffix("/v1")
    cfg = SoakConfig(
        url, args.model, args.minutes, args.concurrency, args.warmup_minutes, args.seed, n_choices=not args.no_choices
    )
    pid = args.pid or asyncio.run(find_worker_pid(url, args.model))
    report = {"label": args.label, "pid": pid, **asyncio.run(soak(cfg, pid))}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("samples", "config")}, indent=1))


if __name__ == "__main__":
    main()
