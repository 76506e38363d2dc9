"""A short request beside a long read: a short chat sent --after-s after a long prompt, its
time to first token against the same kind of chat alone, on mlxgw and the peers.

    mlxgw bench team short ~/.cache/mlxgw/models/qwen2.5-coder-0.5b --mlx-lm \\
        --vllm-python $VLLM_PYTHON --rounds 3

Each server in turn (the order rotated every round: bench/method.py) is started on the model
folder as the day study starts it (day_peers.spawn_server: one batch width, one cache bound),
warmed up, then: --alone short chats one at a time (their median is "alone"), then the long
prompt (~--long-words words, streamed) and, --after-s later, one short chat ("beside"); the
server is stopped after it, so a peer that reads on after its client left costs nothing to the
next. Every prompt has words of its own, so no server finds any of them in a cache. The goal
(a short request beside a long read): beside within 3x alone + 0.5 s. Loopback only; every request has a timeout."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from ..loadgen import RequestResult
from ..method import Method
from ..report import markdown_table, or_dash
from ..servers import ServerProcess, stop_all, warm_up
from .day import _words, stream_chat
from .day_peers import server_labels, spawn_server


def goal_s(alone_s: float) -> float:
    """The longest first-token wait beside a long read that meets the goal."""
    return 3 * alone_s + 0.5


def chat(model: str, text: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": text}],
    }


async def _ttft(session, url: str, body: dict) -> float | None:
    out: list[RequestResult] = []
    await stream_chat(session, url, body, out)
    return out[0].ttft if out and out[0].ok else None


async def measure(args, url: str, model: str, seed: int) -> dict:
    """One server's figures: each alone chat's TTFT, then the chat's beside the long read."""
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        alone = [await _ttft(session, url, chat(model, _words(rng, args.short_words), 8)) for _ in range(args.alone)]
        long_read = asyncio.create_task(_ttft(session, url, chat(model, _words(rng, args.long_words), 16)))
        await asyncio.sleep(args.after_s)
        beside = await _ttft(session, url, chat(model, _words(rng, args.short_words), 8))
        long_read.cancel()  # the client leaves; the server is stopped next
        await asyncio.gather(long_read, return_exceptions=True)
    return {"alone_s": alone, "beside_s": beside}


def one_server(label: str, args, rnd: int, home: Path) -> dict:
    server: ServerProcess | None = None
    try:
        print(f"round {rnd}: starting {label}", file=sys.stderr, flush=True)
        server = spawn_server(label, args, home / f"r{rnd}-{label}")
        server.wait_ready(args.ready_timeout_s)
        warm_up(f"{server.url}/v1", server.model)
        figures = asyncio.run(measure(args, server.url, server.model, rnd))
    finally:
        stop_all([server])
    answered = [t for t in figures["alone_s"] if t is not None]
    alone = statistics.median(answered) if answered else None
    beside = figures["beside_s"]
    met = None if alone is None or beside is None else beside <= goal_s(alone)
    return {"server": label, "round": rnd, "alone_s": alone, "beside_s": beside, "met": met, "each_alone_s": answered}


def _median(rows: list[dict], key: str) -> tuple[float | None, str]:
    """The median of a figure over rounds, and each round's."""
    got = [r[key] for r in rows if r[key] is not None]
    return (statistics.median(got) if got else None), ", ".join(or_dash(r[key]) for r in rows)


def summary(rows: list[dict]) -> str:
    """Per server: alone and beside (median over rounds, each round's), their ratio, rounds meeting the goal."""
    lines = []
    for label in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == label]
        (alone, alone_rounds), (beside, beside_rounds) = _median(mine, "alone_s"), _median(mine, "beside_s")
        ratio = None if not alone or beside is None else beside / alone
        met = sum(1 for r in mine if r["met"])
        row = [label, f"{or_dash(alone)} ({alone_rounds})", f"{or_dash(beside)} ({beside_rounds})"]
        lines.append(row + [or_dash(ratio, "{:.1f}x"), f"{met}/{len(mine)}"])
    header = "server | TTFT alone s (rounds) | TTFT beside the long read s (rounds) | beside / alone | within goal"
    return markdown_table(header, lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path, help="a model folder (the servers are started here)")
    ap.add_argument("--mlx-lm", action="store_true", help="also mlx_lm.server")
    ap.add_argument("--vllm-python", default=None, help="also vllm-mlx, from this venv's python")
    ap.add_argument("--cache-mb", type=int, default=None, help="every server's prefix-cache byte bound (MiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--alone", type=int, default=3, help="short chats alone, one at a time")
    ap.add_argument("--short-words", type=int, default=12, help="the short chat's words (~20 tokens)")
    ap.add_argument("--long-words", type=int, default=5000, help="the long prompt's words (~6,000 tokens)")
    ap.add_argument("--after-s", type=float, default=0.5, help="the short chat's delay after the long prompt")
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--ready-timeout-s", type=float, default=600)
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    args.agents = args.chats = args.typists = args.batch_streams = 1  # day_peers.spawn_server's batch width: 8
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    method = Method(rounds=args.rounds, max_spread=None)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as home:
        for rnd, order in method.each_round(server_labels(args), log=lambda line: print(line, file=sys.stderr)):
            for label in order:
                rows.append(one_server(label, args, rnd + 1, Path(home)))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    table = summary(rows)
    print(table)
    if args.out:
        report = {"args": vars(args), "rows": rows, "method": method.as_dict(), "at": time.time()}
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
        args.out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
