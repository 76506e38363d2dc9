"""A team's whole day at once: typists, agents, chat users and a batch job on one model, each
latency class's time to first token, on mlxgw against mlx_lm.server and vllm-mlx.

    mlxgw bench team day ~/.cache/mlxgw/models/qwen2.5-coder-0.5b --mlx-lm \\
        --vllm-python $VLLM_PYTHON --seconds 600 --rounds 3 --cache-mb 1024 --out day
    mlxgw bench team day --url http://127.0.0.1:8000 --model qwen2.5-coder-0.5b --seconds 60

- typists (the editor class): a file open, then FIM keystrokes at --keys-per-s in bursts,
  each superseding the last (bench/team/typing_session.py's typist); mlxgw gets them on
  /infill, a peer (no /infill) as streaming /v1/completions of the same FIM prompt
  (bench/team/day_peers.py); reported on each burst's last keystroke (one not answered
  within the pause fails), with the share answered within the pause and the file open's p50;
- agents: sessions of three turns on a long shared system prompt with a tool in each
  request (the agent class), no think time;
- chat users: short turns with --think-s between them (the chat class);
- batch: --batch-streams requests at a time with `service_tier: "flex"` (the background
  class). The peers ignore `service_tier`: to them the batch is four more chat users.

Each server in turn (the order rotated every round) is started on the model folder, warmed
up, driven for --seconds, given --drain-s to finish what is in flight (what has no first
token by then fails) and stopped; one prefix-cache byte bound (--cache-mb) and one batch
width for all (day_peers.spawn_server). Per server and class: requests, failures, TTFT
p50 / p90 / p99 and tokens received per second (the batch's is what the batch got), the
median over rounds with each round beside it (bench/report.py); the server's peak RSS (its
process tree); mlxgw's own `/v1/status` classes in the JSON. Loopback only; every request
has a timeout; every server started is stopped."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from ..loadgen import RequestResult
from ..method import Method
from ..servers import ServerProcess, stop_all, warm_up
from .day_peers import fim_format, server_labels, spawn_server, wire_for
from .day_report import class_rows, markdown, merge
from .sessions import sample_rss
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
CUT = "no first token by the end of the round"


@dataclass
class Loads:
    """One server's round: each class's requests, the typists' keystrokes, the wall time."""

    results: dict[str, list[RequestResult]] = field(default_factory=lambda: {"agent": [], "chat": [], "background": []})
    typing: RoundResult = field(default_factory=RoundResult)
    wall: float = 0.0
    typists: int = 0  # each opens a file first: one not open by the end is an editor failure


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _token_chunk(raw: bytes) -> bool:
    """A chat stream's chunk that carries generated text or a tool call (each server spaces
    its JSON its own way, so it is parsed)."""
    if not raw.startswith(b"data: {"):
        return False
    choices = json.loads(raw[6:]).get("choices") or [{}]
    delta = choices[0].get("delta") or {}
    return bool(delta.get("content") or delta.get("tool_calls"))


async def stream_chat(session, url: str, body: dict, out: list[RequestResult]) -> None:
    """One streaming chat request: its TTFT and the chunks it received, or its error. One cut
    at the end of the round is recorded before it stops."""
    sent, first, tokens = time.monotonic(), None, 0
    try:
        async with session.post(f"{url}/v1/chat/completions", json={**body, "stream": True}) as resp:
            if resp.status != 200:
                out.append(RequestResult(False, resp.status, f"HTTP {resp.status}: {(await resp.text())[:120]}"))
                return
            async for raw in resp.content:
                if _token_chunk(raw):
                    first = first or time.monotonic()
                    tokens += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        out.append(RequestResult(False, 0, f"{type(e).__name__}: {e}"[:160]))
        return
    except asyncio.CancelledError:
        ttft = None if first is None else first - sent
        out.append(RequestResult(first is not None, 200, None if first else CUT, ttft, tokens=tokens))
        raise
    if first is None:
        out.append(RequestResult(False, 200, "the stream ended without a token"))
    else:
        out.append(RequestResult(True, 200, ttft=first - sent, tokens=tokens))


async def agent(session, args, target: tuple[str, str, int], seed: int, until: float, out) -> None:
    url, model, day_seed = target
    rng = random.Random(seed)
    system = "You are a coding agent. Rules: " + _words(random.Random(day_seed), args.system_words)
    while time.monotonic() < until:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": _words(rng, 30)}]
        for _turn in range(3):
            body = {"model": model, "messages": messages, "tools": [TOOL], "max_tokens": args.max_tokens}
            await stream_chat(session, url, body, out)
            messages = [*messages, {"role": "assistant", "content": "reading a file"}]
            messages.append({"role": "user", "content": f"file: {_words(rng, 60)}"})
            if time.monotonic() >= until:
                return


async def chat_user(session, args, target: tuple[str, str, int], seed: int, until: float, out) -> None:
    url, model, _ = target
    rng = random.Random(seed)
    while time.monotonic() < until:
        body = {"model": model, "messages": [{"role": "user", "content": _words(rng, 15)}]}
        await stream_chat(session, url, {**body, "max_tokens": args.max_tokens}, out)
        await asyncio.sleep(rng.uniform(0.5 * args.think_s, 1.5 * args.think_s))


async def batch_stream(session, args, target: tuple[str, str, int], seed: int, until: float, out) -> None:
    url, model, _ = target
    rng = random.Random(seed)
    while time.monotonic() < until:
        body = {"model": model, "messages": [{"role": "user", "content": _words(rng, 40)}]}
        await stream_chat(session, url, {**body, "max_tokens": args.max_tokens, "service_tier": "flex"}, out)


async def typists(session, args, wire, seed: int, until: float, typing: RoundResult) -> None:
    cycle = args.burst_chars / args.keys_per_s + args.pause_s
    bursts = max(1, int((until - time.monotonic()) / cycle))
    each = argparse.Namespace(**{**vars(args), "bursts": bursts})
    await asyncio.gather(*(typist(session, each, seed + t, typing, wire) for t in range(args.typists)))


async def server_classes(session, url: str) -> dict | None:
    """mlxgw's latency classes from /v1/status (None from a peer: it has no such route)."""
    try:
        async with session.get(f"{url}/v1/status") as resp:
            return (await resp.json()).get("classes") if resp.status == 200 else None
    except (aiohttp.ClientError, ValueError):
        return None


async def drive(args, url: str, model: str, wire, seed: int) -> tuple[Loads, dict | None]:
    """Every client of the day against one server (its root URL) for --seconds, then --drain-s
    for what is in flight; what is still running then is cut (and recorded)."""
    loads = Loads(typists=args.typists if args.open_file else 0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout_s)
    started = time.monotonic()
    until = started + args.seconds
    target = (url, model, seed)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        r = loads.results
        tasks = [asyncio.ensure_future(typists(session, args, wire, 7000 + 100 * seed, until, loads.typing))]
        tasks += [asyncio.ensure_future(agent(session, args, target, seed * 1000 + a, until, r["agent"]))
                  for a in range(args.agents)]  # fmt: skip
        tasks += [asyncio.ensure_future(chat_user(session, args, target, seed * 1000 + 100 + c, until, r["chat"]))
                  for c in range(args.chats)]  # fmt: skip
        tasks += [asyncio.ensure_future(batch_stream(session, args, target, seed * 1000 + 200 + b, until,
                  r["background"])) for b in range(args.batch_streams)]  # fmt: skip
        _, pending = await asyncio.wait(tasks, timeout=args.seconds + args.drain_s)
        for task in pending:
            task.cancel()
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(outcome, Exception):  # a client that died early: said, not hidden
                print(f"a client of {url} stopped: {type(outcome).__name__}: {outcome}", file=sys.stderr)
        loads.wall = time.monotonic() - started
        classes = await server_classes(session, url)
    return loads, classes


def one_server(label: str, args, rnd: int, home: Path, fmt) -> tuple[list[dict], dict]:
    """Start (or reach) one server, warm it up, drive it, stop it; its class rows and the
    figures that are not rows (mlxgw's /v1/status classes, the round's wall time)."""
    server: ServerProcess | None = None
    done, peak = threading.Event(), [0]
    try:
        if args.url:
            url, model = args.url.removesuffix("/").removesuffix("/v1"), args.model
        else:
            print(f"round {rnd}: starting {label}", file=sys.stderr, flush=True)
            server = spawn_server(label, args, home / f"r{rnd}-{label}")
            server.wait_ready(args.ready_timeout_s)
            url, model = server.url, server.model
        warm_up(f"{url}/v1", model)
        sampler = threading.Thread(target=sample_rss, args=(server, done, peak), daemon=True)
        sampler.start()
        wire = wire_for(label, args, url, model, fmt) if args.typists else None
        loads, classes = asyncio.run(drive(args, url, model, wire, rnd))
        done.set()
        sampler.join()
    finally:
        done.set()
        stop_all([server])
    rows = class_rows(label, rnd, loads, args.pause_s, peak[0] or None)
    return rows, {"server": label, "round": rnd, "wall_s": round(loads.wall, 1), "server_classes": classes}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path, nargs="?", help="a model folder (the servers are started here)")
    ap.add_argument("--url", help="a running server's root URL instead (mlxgw: /infill for the typists)")
    ap.add_argument("--model", default=None, help="the model name at --url")
    ap.add_argument("--fim-completions", action="store_true",
                    help="with --url: type as /v1/completions FIM prompts built from MODEL_DIR (a peer)")  # fmt: skip
    ap.add_argument("--mlx-lm", action="store_true", help="also mlx_lm.server")
    ap.add_argument("--vllm-python", default=None, help="also vllm-mlx, from this venv's python")
    ap.add_argument("--cache-mb", type=int, default=None, help="every server's prefix-cache byte bound (MiB)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--drain-s", type=float, default=60, help="after --seconds, for requests in flight")
    ap.add_argument("--typists", type=int, default=3)
    ap.add_argument("--agents", type=int, default=24)
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
    ap.add_argument("--timeout-s", type=float, default=600, help="a request's longest wait between two reads")
    ap.add_argument("--ready-timeout-s", type=float, default=600)
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    if not args.url and not args.model_dir:
        ap.error("a model folder or --url")
    if args.url and not args.model:
        ap.error("--url needs --model")
    if args.fim_completions and not args.model_dir:
        ap.error("--fim-completions needs the model folder (its FIM tokens)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    labels = ["server"] if args.url else server_labels(args)
    peers = any(label not in ("mlxgw", "server") for label in labels) or args.fim_completions
    fmt = fim_format(args.model_dir) if peers and args.typists else None
    method = Method(rounds=args.rounds, max_spread=None)
    rows: list[dict] = []
    raw: list[dict] = []
    with tempfile.TemporaryDirectory() as home:
        for rnd, order in method.each_round(labels, log=lambda line: print(line, file=sys.stderr)):
            for label in order:
                got, figures = one_server(label, args, rnd + 1, Path(home), fmt)
                rows += got
                raw.append(figures)
    merged = merge(rows)
    table = markdown(merged)
    print(table)
    if args.out:
        report = {"args": vars(args), "rows": rows, "merged": merged, "servers": raw, "method": method.as_dict()}
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
        args.out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
