"""A team's whole day at once against a running server: typists, agents, chat users and a
batch load on one model, with each latency class's time to first token.

    mlxgw bench team day --url http://127.0.0.1:8000 --model qwen2.5-coder-0.5b --seconds 600

- typists: FIM keystrokes on /infill at --keys-per-s in bursts, each superseding the last
  (bench/team/typing_session.py's typist): the editor class; reported as each burst's last
  keystroke's TTFT and the share answered within the pause;
- agents: sessions of turns on a long shared system prompt with a tool in each request (the
  agent class), no think time;
- chat users: short turns with --think-s between them (the chat class);
- batch: --batch-streams requests at a time with service_tier "flex" (the background class).

Per class (client side): requests, errors, TTFT p50 / p90 / p99 and tokens received per
second; the server's own `/v1/status` classes at the end (mlxgw only: waiting, running,
first tokens over target). Keep --seconds short on a shared host; every request has a
timeout and the traffic goes to --url only."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

from ..stats import percentile
from .typing_session import RoundResult, typist

TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}
WORDS = "the a of to in file code test error value list map function return class import loop".split()


@dataclass
class ClassLoad:
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0

    def row(self, name: str, seconds: float) -> dict:
        return {
            "class": name,
            "requests": len(self.ttfts) + self.errors,
            "errors": self.errors,
            "ttft_p50_s": _r(percentile(self.ttfts, 50)),
            "ttft_p90_s": _r(percentile(self.ttfts, 90)),
            "ttft_p99_s": _r(percentile(self.ttfts, 99)),
            "tokens_per_s": round(self.tokens / seconds, 1),
        }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def stream_chat(session, url: str, body: dict, load: ClassLoad) -> None:
    """One streaming chat request: its TTFT and the chunks it received, or an error."""
    sent, first = time.monotonic(), None
    try:
        async with session.post(f"{url}/v1/chat/completions", json={**body, "stream": True}) as resp:
            if resp.status != 200:
                load.errors += 1
                await resp.read()
                return
            async for raw in resp.content:
                if raw.startswith(b"data: {") and (b'"content":"' in raw or b'"tool_calls"' in raw):
                    first = first or time.monotonic()
                    load.tokens += 1
    except (aiohttp.ClientError, asyncio.TimeoutError):
        load.errors += 1
        return
    if first is None:
        load.errors += 1  # nothing came back: not an answer
    else:
        load.ttfts.append(first - sent)


async def agent(session, args, seed: int, until: float, load: ClassLoad) -> None:
    rng = random.Random(seed)
    system = "You are a coding agent. Rules: " + _words(random.Random(7), args.system_words)
    while time.monotonic() < until:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": _words(rng, 30)}]
        for _turn in range(3):
            body = {"model": args.model, "messages": messages, "tools": [TOOL], "max_tokens": args.max_tokens}
            await stream_chat(session, args.url, body, load)
            messages = [*messages, {"role": "assistant", "content": "reading a file"}]
            messages.append({"role": "user", "content": f"file: {_words(rng, 60)}"})
            if time.monotonic() >= until:
                return


async def chat_user(session, args, seed: int, until: float, load: ClassLoad) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        body = {"model": args.model, "messages": [{"role": "user", "content": _words(rng, 15)}]}
        await stream_chat(session, args.url, {**body, "max_tokens": args.max_tokens}, load)
        await asyncio.sleep(rng.uniform(0.5 * args.think_s, 1.5 * args.think_s))


async def batch(session, args, until: float, load: ClassLoad) -> None:
    rng = random.Random(99)

    async def one_stream() -> None:
        while time.monotonic() < until:
            body = {"model": args.model, "messages": [{"role": "user", "content": _words(rng, 40)}]}
            await stream_chat(session, args.url, {**body, "max_tokens": args.max_tokens, "service_tier": "flex"}, load)

    await asyncio.gather(*(one_stream() for _ in range(args.batch_streams)))


async def typists(session, args, until: float, typing: RoundResult) -> None:
    cycle = args.burst_chars / args.keys_per_s + args.pause_s
    args.bursts = max(1, int((until - time.monotonic()) / cycle))
    await asyncio.gather(*(typist(session, args, 7000 + t, typing) for t in range(args.typists)))


async def server_classes(session, url: str) -> dict | None:
    try:
        async with session.get(f"{url}/v1/status") as resp:
            return (await resp.json()).get("classes") if resp.status == 200 else None
    except (aiohttp.ClientError, ValueError):
        return None


async def day(args) -> dict:
    loads = {name: ClassLoad() for name in ("agent", "chat", "background")}
    typing = RoundResult()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout_s)
    started = time.monotonic()
    until = started + args.seconds
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(
            typists(session, args, until, typing),
            *(agent(session, args, a, until, loads["agent"]) for a in range(args.agents)),
            *(chat_user(session, args, 100 + c, until, loads["chat"]) for c in range(args.chats)),
            batch(session, args, until, loads["background"]),
        )
        wall = time.monotonic() - started
        classes = await server_classes(session, args.url)
    last = [k for k in typing.keystrokes if k.last_of_burst]
    ttft = [k.first_token - k.sent for k in last if k.first_token is not None]
    editor = ClassLoad(ttfts=ttft, errors=len(last) - len(ttft))
    editor.tokens = sum(k.delivered for k in typing.keystrokes)
    rows = [editor.row("editor", wall)] + [load.row(name, wall) for name, load in loads.items()]
    within = sum(1 for t in ttft if t <= args.pause_s)
    return {
        "seconds": round(wall, 1),
        "rows": rows,
        "keystrokes": len(typing.keystrokes),
        "answered_within_pause": round(within / len(last), 3) if last else None,
        "file_open_p50_s": _r(percentile(typing.open_s, 50)),
        "server_classes": classes,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--typists", type=int, default=3)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--chats", type=int, default=6)
    ap.add_argument("--batch-streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--system-words", type=int, default=600)
    ap.add_argument("--think-s", type=float, default=5.0)
    ap.add_argument("--keys-per-s", type=float, default=5.0)
    ap.add_argument("--burst-chars", type=int, default=8)
    ap.add_argument("--pause-s", type=float, default=3.0)
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--file-lines", type=int, default=260)
    ap.add_argument("--shape", choices=("lines", "prefix"), default="lines")
    ap.add_argument("--open-file", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--timeout-s", type=float, default=120)
    args = ap.parse_args(argv)
    print(json.dumps(asyncio.run(day(args)), indent=1))


if __name__ == "__main__":
    main()
