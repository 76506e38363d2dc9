"""A team day against a real `mlxgw up`: who gets the machine, not how much it does.

Two measurements, each with fair share on and off (MLXGW_FAIR_SHARE in the gateway's
environment), one API key per simulated user:

- flood vs one: key A keeps --flood streams running, key B sends one request at a time.
  B's TTFT p50 against B alone on the idle machine, and A's tokens/s against A alone.
- team day: agents (a long shared system prompt, bursts of parallel requests, tool-loop
  turns), chat users (short turns, reading between them), an embedding job (when an
  embedding model is given), a batch job (Files + Batch API), and one user who floods.
  Per user: requests, errors (refusals counted apart), TTFT p50/p99, tokens/s; Jain's
  fairness index over the interactive users' responsiveness (1 / TTFT p50); nothing lost
  (every request answered or explicitly refused).

    .venv/bin/python -m mlxgw.bench.team.teamday --models-dir DIR --model tiny [--seconds 30]

Bounded: every phase runs --seconds, every request has a timeout, traffic is to 127.0.0.1."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path

import yaml

from ..report import markdown_table
from ..servers import ServerProcess, spawn_mlx_lm, spawn_vllm_mlx, start_mlxgw, warm_up
from .teamday_users import (
    SERVED,
    UserStats,
    agent,
    batch_job,
    chat,
    embedder,
    flooder,
    jain,
    key_of,
    one_at_a_time,
    pct,
    ratio,
    session_for,
    words,
)


# -- the measurements --------------------------------------------------------------------------
async def flood_vs_one(url: str, seconds: float, flood: int, max_tokens: int) -> dict:
    b_alone, a_alone = UserStats("bob", "one"), UserStats("alice", "flood")
    await one_at_a_time(url, b_alone, time.perf_counter() + seconds / 2, max_tokens)
    a_alone.started = time.perf_counter()
    await flooder(url, a_alone, flood, time.perf_counter() + seconds / 2, max_tokens)
    a, b = UserStats("alice", "flood"), UserStats("bob", "one")
    until = time.perf_counter() + seconds
    await asyncio.gather(flooder(url, a, flood, until, max_tokens), one_at_a_time(url, b, until, max_tokens))
    return {
        "b_alone_ttft_p50_s": pct(b_alone.ttfts, 50),
        "b_flooded_ttft_p50_s": pct(b.ttfts, 50),
        "b_flooded_ttft_p99_s": pct(b.ttfts, 99),
        "b_slowdown": ratio(pct(b.ttfts, 50), pct(b_alone.ttfts, 50)),
        "a_alone_tok_s": round(a_alone.tokens / (seconds / 2), 1),
        "a_with_b_tok_s": round(a.tokens / seconds, 1),
        "a_ratio": ratio(a.tokens / seconds, a_alone.tokens / (seconds / 2)),
        "lost": a.errors + b.errors + a_alone.errors + b_alone.errors,
    }


async def batch_vs_direct(url: str, n: int, max_tokens: int, seconds: float) -> dict:
    """The same n requests sent directly (8 at a time, as the batch runner does) and as a
    batch on the idle machine; then a chat user's TTFT alone and beside a running batch."""
    rng = random.Random(3)
    prompts = [[{"role": "user", "content": words(rng, 12)}] for _ in range(n)]
    direct = UserStats("batch", "direct")
    started = time.perf_counter()
    async with session_for("batch") as session:
        queue = list(prompts)

        async def worker() -> None:
            while queue:
                direct.add(await chat(session, url, queue.pop(), max_tokens))

        await asyncio.gather(*(worker() for _ in range(8)))
    direct_s = time.perf_counter() - started
    as_batch = await batch_job(url, UserStats("batch", "batch"), n, max_tokens)
    alone = UserStats("chat0", "chat")
    await one_at_a_time(url, alone, time.perf_counter() + seconds / 2, max_tokens, think_s=0.5)
    beside = UserStats("chat0", "chat")
    job = asyncio.create_task(batch_job(url, UserStats("batch", "batch"), 4 * n, max_tokens))
    await one_at_a_time(url, beside, time.perf_counter() + seconds / 2, max_tokens, think_s=0.5)
    job.cancel()
    return {
        "direct_s": round(direct_s, 1),
        "batch_s": as_batch["seconds"],
        "batch_vs_direct": ratio(direct_s, as_batch["seconds"]),
        "chat_ttft_p50_alone_s": pct(alone.ttfts, 50),
        "chat_ttft_p50_beside_batch_s": pct(beside.ttfts, 50),
        "chat_ttft_p99_beside_batch_s": pct(beside.ttfts, 99),
        "lost": direct.errors + alone.errors + beside.errors,
    }


async def idle_baselines(url: str, system: str, args) -> dict[str, float | None]:
    """TTFT p50 of each interactive shape alone on the idle machine (an agent's burst, a chat turn)."""
    agent_alone, chat_alone = UserStats("agent0", "agent"), UserStats("chat0", "chat")
    await agent(url, agent_alone, time.perf_counter() + 0.1, system, args.burst, args.max_tokens)
    for _ in range(3):
        await one_at_a_time(url, chat_alone, time.perf_counter() + 0.01, args.max_tokens)
    return {"agent": pct(agent_alone.ttfts, 50), "chat": pct(chat_alone.ttfts, 50)}


async def team_day(url: str, seconds: float, args) -> dict:
    system = "You are a coding agent. Tools and rules: " + words(random.Random(7), args.system_words)
    idle = await idle_baselines(url, system, args)
    users = (
        [UserStats(f"agent{i}", "agent") for i in range(args.agents)]
        + [UserStats(f"chat{i}", "chat") for i in range(args.chats)]
        + [UserStats("flooder", "flood"), UserStats("batch", "batch")]
        + ([UserStats("embedder", "embed")] if args.embed_model else [])
    )
    until = time.perf_counter() + seconds
    tasks = []
    for u in users:
        if u.kind == "agent":
            tasks.append(agent(url, u, until, system, args.burst, args.max_tokens))
        elif u.kind == "chat":
            tasks.append(one_at_a_time(url, u, until, args.max_tokens, think_s=args.think_s))
        elif u.kind == "flood":
            tasks.append(flooder(url, u, args.flood, until, args.max_tokens))
        elif u.kind == "embed":
            tasks.append(embedder(url, u, until))
    batch_user = next(u for u in users if u.kind == "batch")
    if not args.batch_n:
        users.remove(batch_user)
    else:
        tasks.append(batch_job(url, batch_user, args.batch_n, args.max_tokens))
    results = await asyncio.gather(*tasks)
    batch_result = results[-1] if args.batch_n else None
    wall = time.perf_counter() - min(u.started for u in users)
    rows = [u.row(wall, idle.get(u.kind)) for u in users]
    interactive = [r for r in rows if r["kind"] in ("agent", "chat")]
    # Each user's responsiveness against its own shape alone: agents' long prompts take
    # longer than chat turns on an idle machine too, which is not unfairness.
    served = [r["idle_ttft_s"] / r["ttft_p50_s"] for r in interactive if r["ttft_p50_s"] and r["idle_ttft_s"]]
    return {
        "rows": rows,
        "idle_ttft_s": idle,
        "jain_interactive": jain(served),
        "jain_ttft_p50": jain([1 / r["ttft_p50_s"] for r in interactive if r["ttft_p50_s"]]),
        "batch": batch_result,
        "lost": sum(r["errors"] for r in rows),
    }


def table(rows: list[dict]) -> str:
    cols = list(rows[0])
    return markdown_table(cols, (["–" if r[c] is None else r[c] for c in cols] for r in rows))


def start_gateway(
    home: Path, models_dir: Path, model: str, users: list[str], fair: bool, seqs: int, embed: str | None
) -> ServerProcess:
    """`mlxgw up` with one key per user, the chat model (and the embedding model), fair share
    on or off, ready."""
    from ...gateway.access.keys import hash_key

    home.mkdir(parents=True, exist_ok=True)
    if not (home / "models").exists():
        (home / "models").symlink_to(models_dir)
    entries = [{"name": u, "sha256": hash_key(key_of(u))} for u in users]
    (home / "keys.yaml").write_text(yaml.safe_dump({"window_seconds": 60, "keys": entries}))
    models = [{"name": "chat", "source": model, "preload": True, "max_num_seqs": seqs, "max_queue": 256}]
    if embed:
        models.append({"name": "embed", "source": embed, "kind": "embedding", "preload": True})
    config = {"manager": {"auto_discover": False}, "models": models}
    name = f"gateway-{'fair' if fair else 'fifo'}"
    env = {"MLXGW_FAIR_SHARE": "on" if fair else "off"}
    return start_mlxgw(home, config, name, env=env, extra_args=["--keys", str(home / "keys.yaml")])


PEERS = ("mlx_lm", "vllm")


def start_peer(mode: str, home: Path, args) -> ServerProcess:
    """mlx_lm.server or vllm-mlx on the same model folder, each with its own defaults, ready."""
    model_dir = (args.models_dir / args.model).resolve()
    if mode == "mlx_lm":
        server = spawn_mlx_lm(model_dir, home)
    elif args.vllm_python:
        server = spawn_vllm_mlx(args.vllm_python, model_dir, home)
    else:
        raise SystemExit("--modes vllm needs --vllm-python (the python of a venv with vllm-mlx)")
    try:
        server.wait_ready()
        warm_up(server.api, server.model)
    except BaseException:
        server.stop()
        raise
    SERVED["model"] = server.model
    return server


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models-dir", type=Path, required=True)
    ap.add_argument("--model", default="tiny", help="a model folder under --models-dir")
    ap.add_argument("--embed-model", default=None, help="an embedding model folder (optional)")
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--flood", type=int, default=32, help="the flooding key's parallel streams")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--chats", type=int, default=6)
    ap.add_argument("--burst", type=int, default=3)
    ap.add_argument("--think-s", type=float, default=2.0)
    ap.add_argument("--system-words", type=int, default=400)
    ap.add_argument("--batch-n", type=int, default=24)
    ap.add_argument(
        "--modes",
        default="fair,fifo",
        help="fair, fifo (fair share off), batch (only batch vs direct), mlx_lm and vllm (the peers: the chat, "
        "agent and flooding users; they have no keys, fair share, batch or embedding API)",
    )
    ap.add_argument("--vllm-python", default=None, help="the python of a venv with vllm-mlx (--modes vllm)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    users = ["alice", "bob", "flooder", "batch", "embedder"]
    users += [f"agent{i}" for i in range(args.agents)] + [f"chat{i}" for i in range(args.chats)]
    results = {"load_average": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()}}
    for mode in args.modes.split(","):
        home = Path(tempfile.mkdtemp(prefix=f"teamday-{mode}-"))
        if mode in PEERS:
            server = start_peer(mode, home, args)
            run_args = argparse.Namespace(**{**vars(args), "batch_n": 0, "embed_model": None})
        else:
            SERVED["model"] = "chat"
            fair = mode != "fifo"
            server = start_gateway(
                home, args.models_dir.resolve(), args.model, users, fair, args.max_num_seqs, args.embed_model
            )
            run_args = args
        url = server.api
        try:
            if mode == "batch":  # only the batch measurement
                bvd = asyncio.run(batch_vs_direct(url, args.batch_n, args.max_tokens, args.seconds))
                print(f"[{mode}] batch vs direct: {json.dumps(bvd)}  load {os.getloadavg()}", flush=True)
                results[mode] = {"batch_vs_direct": bvd}
                continue
            fvo = asyncio.run(flood_vs_one(url, args.seconds, args.flood, args.max_tokens))
            print(f"[{mode}] flood vs one: {json.dumps(fvo)}  load {os.getloadavg()}", flush=True)
            day = asyncio.run(team_day(url, args.seconds, run_args))
            print(
                f"[{mode}] team day: Jain {day['jain_interactive']} (vs idle), {day['jain_ttft_p50']} (1/TTFT p50),"
                f" batch {day['batch']}, lost {day['lost']}"
            )
            print(table(day["rows"]), flush=True)
            results[mode] = {"flood_vs_one": fvo, "team_day": day, "load_average_after": os.getloadavg()}
            if mode == "fair" and args.batch_n:
                bvd = asyncio.run(batch_vs_direct(url, args.batch_n, args.max_tokens, args.seconds))
                print(f"[{mode}] batch vs direct: {json.dumps(bvd)}  load {os.getloadavg()}", flush=True)
                results[mode]["batch_vs_direct"] = bvd
        finally:
            server.stop(timeout=60)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
