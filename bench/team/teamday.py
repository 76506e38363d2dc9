"""A team day against a real `mlxgw up` (issue 28): who gets the machine, not how much it does.

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
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from mlxgw.bench.hostile.flood import free_port
from mlxgw.bench.loadgen import WORDS, one_request


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
            "p99_vs_idle": _ratio(pct(self.ttfts, 99), idle_ttft),
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


# -- the gateway -------------------------------------------------------------------------------
def key_of(name: str) -> str:
    return f"mlxgw-bench-{name}-" + hashlib.sha256(name.encode()).hexdigest()[:16]


def start_gateway(home: Path, models_dir: Path, model: str, users: list[str], fair: bool, seqs: int, embed: str | None):
    from mlxgw.gateway.access.keys import hash_key

    home.mkdir(parents=True, exist_ok=True)
    if not (home / "models").exists():
        (home / "models").symlink_to(models_dir)
    entries = [{"name": u, "sha256": hash_key(key_of(u))} for u in users]
    (home / "keys.yaml").write_text(yaml.safe_dump({"window_seconds": 60, "keys": entries}))
    models = [{"name": "chat", "source": model, "preload": True, "max_num_seqs": seqs, "max_queue": 256}]
    if embed:
        models.append({"name": "embed", "source": embed, "kind": "embedding", "preload": True})
    (home / "teamday.yaml").write_text(yaml.safe_dump({"manager": {"auto_discover": False}, "models": models}))
    port = free_port()
    env = dict(os.environ, MLXGW_HOME=str(home), PYTHONUNBUFFERED="1", MLXGW_FAIR_SHARE="on" if fair else "off")
    log = open(home / f"gateway-{'fair' if fair else 'fifo'}.log", "w")
    cmd = [sys.executable, "-c", "from mlxgw.cli import main; main()", "up", "--config", str(home / "teamday.yaml")]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--keys", str(home / "keys.yaml")], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 300
    while "mlxgw ready on" not in Path(log.name).read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(Path(log.name).read_text()[-3000:])
        time.sleep(0.3)
    return f"http://127.0.0.1:{port}/v1", proc


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
        "b_slowdown": _ratio(pct(b.ttfts, 50), pct(b_alone.ttfts, 50)),
        "a_alone_tok_s": round(a_alone.tokens / (seconds / 2), 1),
        "a_with_b_tok_s": round(a.tokens / seconds, 1),
        "a_ratio": _ratio(a.tokens / seconds, a_alone.tokens / (seconds / 2)),
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
        "batch_vs_direct": _ratio(direct_s, as_batch["seconds"]),
        "chat_ttft_p50_alone_s": pct(alone.ttfts, 50),
        "chat_ttft_p50_beside_batch_s": pct(beside.ttfts, 50),
        "chat_ttft_p99_beside_batch_s": pct(beside.ttfts, 99),
        "lost": direct.errors + alone.errors + beside.errors,
    }


def _ratio(x, y) -> float | None:
    return round(x / y, 2) if x and y else None


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
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("–" if r[c] is None else str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


PEERS = ("mlx_lm", "vllm")


def start_peer(mode: str, home: Path, args) -> tuple[str, subprocess.Popen]:
    """mlx_lm.server or vllm-mlx on the same model folder, each with its own defaults."""
    from mlxgw.bench.serving.peers import start_mlx_lm, start_vllm_mlx, wait_ready, warm_up

    model_dir = (args.models_dir / args.model).resolve()
    log = open(home / f"{mode}.log", "w")
    if mode == "mlx_lm":
        url, proc, model = start_mlx_lm(model_dir, log)
    else:
        url, proc, model = start_vllm_mlx(args.vllm_python, model_dir, log)
    wait_ready(url, proc)
    warm_up(url, model)
    SERVED["model"] = model
    return url, proc


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
    ap.add_argument("--vllm-python", default="/work/peers/vllm/bin/python", help="the vllm-mlx venv's python")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    users = ["alice", "bob", "flooder", "batch", "embedder"]
    users += [f"agent{i}" for i in range(args.agents)] + [f"chat{i}" for i in range(args.chats)]
    results = {"load_average": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()}}
    for mode in args.modes.split(","):
        home = Path(tempfile.mkdtemp(prefix=f"teamday-{mode}-"))
        if mode in PEERS:
            url, proc = start_peer(mode, home, args)
            run_args = argparse.Namespace(**{**vars(args), "batch_n": 0, "embed_model": None})
        else:
            SERVED["model"] = "chat"
            fair = mode != "fifo"
            url, proc = start_gateway(
                home, args.models_dir.resolve(), args.model, users, fair, args.max_num_seqs, args.embed_model
            )
            run_args = args
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
            proc.terminate()
            proc.wait(60)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
