"""A typing session against /infill: typists edit a 2-4k-token file at a few
keystrokes per second, each keystroke a streaming FIM request that supersedes the last (the
client drops it, the server cancels it), beside agent sessions decoding long chat answers.

    python -m mlxgw.bench.team.typing_session --url http://127.0.0.1:8000 --model qwen2.5-coder-0.5b \\
        --typists 3 --agents 4 --keys-per-s 5 --bursts 6 --rounds 3

A typist opens its file (an `n_predict: 0` request, waited for, as llama.vscode warms the
server on opening a file; `--no-open-file` types at once), then types a burst of characters
(--burst-chars) at --keys-per-s, then pauses (--pause-s) to read the suggestion, as people do.
Requests are shaped as llama.vscode sends them (`--shape lines`: the cursor's line as `prompt`)
or with the cursor's line in the prefix (`--shape prefix`, as Continue builds FIM).
Per round it reports the file-open read's p50, the TTFT p50/p90 of each burst's last
keystroke (the request that is not superseded), the share of those answered within the
pause, the decoded tokens no client received (the worker's generated-token counter over the
round, less what clients were sent: an upper bound on tokens wasted on superseded
requests), and the share of prompt tokens read from the prefix cache. Compare servers by
pointing --url at llama.cpp's `llama-server` (same /infill) with the same model in GGUF;
agent sessions then need its /v1/chat/completions too."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

from ..stats import percentile, summarize

AGENT_PROMPT = "Explain, step by step and at length, how a hash map handles collisions."


@dataclass
class Keystroke:
    sent: float
    first_token: float | None = None
    delivered: int = 0  # tokens the client received (the final event's count)
    evaluated: int = 0
    cached: int = 0
    last_of_burst: bool = False
    error: str | None = None  # the server refused it (its HTTP status): not an answer


@dataclass
class RoundResult:
    keystrokes: list[Keystroke] = field(default_factory=list)
    generated: int | None = 0  # the worker's counter over the round (None: the server has none)
    agent_tokens: int = 0  # chunks the agent sessions received (one token each)
    open_s: list[float] = field(default_factory=list)  # each typist's file-open read (--open-file)

    def figures(self) -> dict:
        last = [k for k in self.keystrokes if k.last_of_burst]
        ttft = [k.first_token - k.sent for k in last if k.first_token is not None]
        evaluated = sum(k.evaluated for k in self.keystrokes)
        delivered = sum(k.delivered for k in self.keystrokes)
        return {
            "keystrokes": len(self.keystrokes),
            "open_p50_s": percentile(self.open_s, 50),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "answered_share": len(ttft) / len(last) if last else None,
            "undelivered_tokens": (
                None if self.generated is None else max(self.generated - delivered - self.agent_tokens, 0)
            ),
            "cached_prompt_share": sum(k.cached for k in self.keystrokes) / evaluated if evaluated else None,
        }


def source_file(lines: int, seed: int) -> str:
    """A Python file of about 12 tokens a line (200-330 lines: 2-4k tokens)."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        if i % 6 == 0:
            out.append(f"def step_{i}(values, scale={rng.randint(1, 9)}):")
        else:
            out.append(f"    values = [v * scale + {rng.randint(0, 99)} for v in values if v > {i}]")
    return "\n".join(out) + "\n"


async def _keystroke(session: aiohttp.ClientSession, url: str, body: dict, key: Keystroke) -> None:
    """One streaming /infill, read until its last event or until it is cancelled."""
    async with session.post(f"{url}/infill", json=body) as resp:
        if resp.status != 200:
            key.error = f"HTTP {resp.status}"
            return
        async for raw in resp.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if key.first_token is None and (event.get("content") or event.get("stop")):
                key.first_token = time.monotonic()
            key.delivered += 1 if event.get("content") else 0  # also of a stream cut before its end
            if event.get("stop"):
                key.delivered = event.get("tokens_predicted", key.delivered)
                key.evaluated = event.get("tokens_evaluated", 0)
                key.cached = event.get("tokens_cached", 0)


# llama.vscode's defaults: lines of context above and below the cursor's line
PREFIX_LINES, SUFFIX_LINES = 256, 64


def infill_fields(before: str, after: str, shape: str) -> dict:
    """The /infill text fields for a cursor between `before` and `after`. "lines": as
    llama.vscode and llama.vim send them (the lines above as input_prefix, the cursor's line
    up to the cursor as prompt, the rest as input_suffix), so typing on a line changes only
    the prompt's end; "prefix": the cursor's line in input_prefix, as Continue builds FIM."""
    if shape == "prefix":
        return {"input_prefix": before, "input_suffix": after}
    start = before.rfind("\n") + 1
    above = before[:start].splitlines(keepends=True)[-PREFIX_LINES:]
    below = after.splitlines(keepends=True)[: SUFFIX_LINES + 1]
    return {"input_prefix": "".join(above), "prompt": before[start:], "input_suffix": "".join(below)}


class InfillWire:
    """Keystrokes as llama.cpp's /infill (mlxgw, llama-server); a server without it gets its
    keystrokes another way (bench/team/day_peers.py's CompletionsWire, same two methods)."""

    def __init__(self, url: str, model: str, shape: str, n_predict: int):
        self.url, self.model, self.shape, self.n_predict = url, model, shape, n_predict

    async def open(self, session, prefix: str, suffix: str, filename: str) -> None:
        """As llama.vscode does on opening a file: read the prompt, answer nothing."""
        body = {"model": self.model, **infill_fields(prefix, suffix, self.shape), "n_predict": 0, "filename": filename}
        async with session.post(f"{self.url}/infill", json=body) as resp:
            await resp.read()

    async def keystroke(self, session, prefix: str, suffix: str, filename: str, key: Keystroke) -> None:
        body = {"model": self.model, **infill_fields(prefix, suffix, self.shape), "n_predict": self.n_predict,
                "stream": True, "t_max_predict_ms": 500, "filename": filename}  # fmt: skip
        await _keystroke(session, self.url, body, key)


async def typist(session, args, seed: int, result: RoundResult, wire=None) -> None:
    wire = wire or InfillWire(args.url, args.model, args.shape, args.n_predict)
    filename = f"typist_{seed}.py"
    text = source_file(args.file_lines, seed)
    rng = random.Random(seed)
    cursor = rng.randrange(len(text) // 3, 2 * len(text) // 3)
    cursor = text.index("\n", cursor) + 1
    prefix, suffix = text[:cursor], text[cursor:]
    typed = "    values = sorted(values, key=lambda v: -v)\n" * args.bursts
    position = 0
    if args.open_file:
        opened = time.monotonic()
        await wire.open(session, prefix, suffix, filename)
        result.open_s.append(time.monotonic() - opened)
    for _ in range(args.bursts):
        pending: asyncio.Task | None = None
        for i in range(args.burst_chars):
            prefix += typed[position]
            position += 1
            if pending is not None and not pending.done():
                pending.cancel()  # the editor drops the older request; the server cancels it too
            key = Keystroke(time.monotonic(), last_of_burst=i == args.burst_chars - 1)
            result.keystrokes.append(key)
            pending = asyncio.ensure_future(wire.keystroke(session, prefix, suffix, filename, key))
            await asyncio.sleep(1 / args.keys_per_s)
        try:
            await asyncio.wait_for(pending, args.pause_s)
        except (asyncio.TimeoutError, aiohttp.ClientError):
            pass


async def agent(session, args, stop: asyncio.Event, result: RoundResult) -> None:
    body = {"model": args.model, "messages": [{"role": "user", "content": AGENT_PROMPT}],
            "max_tokens": args.agent_tokens, "stream": True}  # fmt: skip
    while not stop.is_set():
        try:
            async with session.post(f"{args.url}/v1/chat/completions", json=body) as resp:
                async for raw in resp.content:
                    if raw.startswith(b"data: {") and b'"content":"' in raw:
                        result.agent_tokens += 1
                    if stop.is_set():
                        break
        except aiohttp.ClientError:
            await asyncio.sleep(0.5)


async def generated_tokens(session, url: str, model: str) -> int | None:
    """The worker's generated-token counter; None from a server that has no /v1/status
    (llama-server): its wasted tokens are then not reported."""
    async with session.get(f"{url}/v1/status") as resp:
        if resp.status != 200:
            return None
        status = await resp.json()
    for m in status.get("models", []):
        if m.get("name") == model:
            return sum(w.get("stats", {}).get("generated_tokens", 0) for w in m.get("workers", []))
    return 0


async def one_round(args, index: int) -> RoundResult:
    result = RoundResult()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        before = await generated_tokens(session, args.url, args.model)
        stop = asyncio.Event()
        agents = [asyncio.ensure_future(agent(session, args, stop, result)) for _ in range(args.agents)]
        await asyncio.gather(*(typist(session, args, 1000 * index + t, result) for t in range(args.typists)))
        stop.set()
        for task in agents:
            task.cancel()
        await asyncio.gather(*agents, return_exceptions=True)
        after = await generated_tokens(session, args.url, args.model)
        result.generated = after - before if after is not None and before is not None else None
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--typists", type=int, default=3)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--agent-tokens", type=int, default=512)
    ap.add_argument("--keys-per-s", type=float, default=5.0)
    ap.add_argument("--burst-chars", type=int, default=8)
    ap.add_argument("--pause-s", type=float, default=3.0)
    ap.add_argument("--bursts", type=int, default=6)
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--file-lines", type=int, default=260)
    ap.add_argument("--shape", choices=("lines", "prefix"), default="lines", help=infill_fields.__doc__)
    ap.add_argument(
        "--open-file", action=argparse.BooleanOptionalAction, default=True,
        help="each typist first reads its file with n_predict 0, as llama.vscode does on opening one",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=120)
    ap.add_argument("--first-round", type=int, default=1, help="number of the first round (its files' seeds)")
    args = ap.parse_args()
    rounds = []
    # --first-round lets two servers alternate round by round on the same files (one run each).
    for index in range(args.first_round - 1, args.first_round - 1 + args.rounds):
        figures = asyncio.run(one_round(args, index)).figures()
        print(json.dumps({"round": index + 1, **figures}))
        rounds.append(figures)
    summary = {
        key: summarize([r[key] for r in rounds]).cell(3)
        for key in rounds[0]
        if key != "keystrokes" and all(r[key] is not None for r in rounds)
    }
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()
