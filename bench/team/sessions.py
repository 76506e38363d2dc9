"""A team's agent sessions at once on one server: the shared prefix, turn by turn.

N sessions start together. Each is a shared system prompt (the same for every session, as a
team's coding agents share their client's system prompt and tools), its own repository
context, then `--turns` user turns of a few sentences, each sent after a think time drawn
from an exponential distribution, the answers appended to the conversation as an agent
does. Every request streams; per turn the table shows TTFT p50/p90/p99, decode tokens/s,
the share of prompt tokens the server reported as cached (`usage.prompt_tokens_details`,
when it reports it) and requests lost (errors and timeouts: must be 0).

Servers: a running one (`--url`, `--model`), or started here on one model folder with the
same BLAS: mlxgw (`mlxgw up`), `mlx_lm.server` (`--mlx-lm`, with `--prompt-cache-size` at
least the number of sessions: its default of 10 entries would thrash) and vllm-mlx
(`--vllm-python`). `--rounds` rounds, the servers' order rotated every round. Each session
sends its own API key; `--cache-groups` also runs mlxgw with those keys in force, each key
its own cache namespace (`mlxgw-key-each`: nothing shared between sessions, the secure
default) and all in one cache group (`mlxgw-one-group`): what sharing a group buys.

    python -m mlxgw.bench.team.sessions ~/.cache/mlxgw/models/smollm2-135m --sessions 8 \\
        --turns 4 --mlx-lm --rounds 3 [--out team.json]

Only loopback ports; every server started is stopped at the end."""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from ..report import markdown_table, or_dash
from ..servers import (
    ServerProcess,
    registry,
    spawn_mlx_lm,
    spawn_mlxgw,
    spawn_vllm_mlx,
    stop_all,
    warm_up,
)

WORDS = "scheduler cache block prefix worker gateway token batch stream model test commit".split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) + (". " if i % 12 == 11 else "") for i in range(words))


ADMIN_KEY = "mlxgw-bench-admin-0123456789abcdef"  # reads /v1/status where keys are in force


def session_key(k: int) -> str:
    return f"mlxgw-bench-session-{k}-0123456789abcdef"


def keys_file(path: Path, sessions: int, group: str | None) -> Path:
    """One key per session (in one cache group, or each its own) and an admin key."""
    import yaml

    from ...gateway.access.keys import hash_key

    entries = [{"name": "bench-admin", "sha256": hash_key(ADMIN_KEY), "admin": True}]
    for k in range(sessions):
        entry = {"name": f"session-{k}", "sha256": hash_key(session_key(k))}
        entries.append(entry | ({"cache_group": group} if group else {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"keys": entries}))
    return path


def stream_chat(
    url: str,
    model: str,
    messages: list[dict],
    max_tokens: int,
    timeout: float,
    key: str | None = None,
    headers: dict | None = None,
) -> dict:
    """One greedy streaming chat request: TTFT, decode chunks/s, the text and the usage.
    headers: more request headers (a client's session id: bench/team/replicas.py)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(f"{url}/chat/completions", json.dumps(body).encode(), sent | (headers or {}))
    started = time.perf_counter()
    first = last = None
    pieces: list[str] = []
    usage: dict = {}
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or []
            piece = (choices[0].get("delta") or {}).get("content") if choices else None
            if piece:
                last = time.perf_counter()
                first = first or last
                pieces.append(piece)
    decode = (len(pieces) - 1) / (last - first) if len(pieces) > 1 and last > first else None
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": first - started if first else None,
        "decode_per_s": decode,
        "text": "".join(pieces),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
    }


def run_session(
    k: int, url: str, model: str, args: argparse.Namespace, seed: int, system: str, out: list[dict]
) -> None:
    rng = random.Random(seed * 1000 + k)
    messages = [{"role": "system", "content": system}]
    context = f"Repository {k}: " + text(rng, args.own_words)
    for turn in range(args.turns):
        if turn:
            time.sleep(rng.expovariate(1 / args.think_s) if args.think_s > 0 else 0)
        ask = (context + "\n\n" if turn == 0 else "") + text(rng, args.turn_words)
        messages.append({"role": "user", "content": ask})
        row = {"session": k, "turn": turn}
        try:
            row |= stream_chat(url, model, messages, args.max_tokens, args.timeout_s, session_key(k))
        except Exception as e:  # a lost request is a result: counted, never a crash of the study
            row["error"] = f"{type(e).__name__}: {e}"[:200]
            out.append(row)
            return
        if row["ttft_s"] is None:  # 200 with no token: vllm-mlx ends a request it gave up on so
            row["error"] = "an answer without a token"  # at 64 sessions (its 300 s abort): lost
        messages.append({"role": "assistant", "content": row.pop("text")})
        out.append(row)


def study(url: str, model: str, args: argparse.Namespace, seed: int, server: ServerProcess | None = None) -> dict:
    """Every session at once against one server: one row per request, the server's peak RSS
    (its process tree, sampled) and, from mlxgw's /v1/status, where prompt tokens came from.
    seed: the round's (every round's prompts are new to every server)."""
    system = f"You are coding agent {seed} for a team. " + text(random.Random(seed), args.system_words)
    rows: list[dict] = []
    threads = [
        threading.Thread(target=run_session, args=(k, url, model, args, seed, system, rows))
        for k in range(args.sessions)
    ]
    before = cache_counters(url, model)
    done = threading.Event()
    peak = [0]
    sampler = threading.Thread(target=sample_rss, args=(server, done, peak), daemon=True)
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    sampler.join()
    after = cache_counters(url, model)
    deadline = time.monotonic() + 10  # the status is refreshed by the worker's periodic report
    while (
        before is not None and after is not None and after["prompt"] == before["prompt"] and time.monotonic() < deadline
    ):
        time.sleep(0.5)
        after = cache_counters(url, model)
    tiers = None
    if before is not None and after is not None:
        tiers = {k: after[k] - before[k] for k in after}
    return {"rows": rows, "peak_rss_bytes": peak[0] or None, "tiers": tiers}


def sample_rss(server: ServerProcess | None, done: threading.Event, peak: list[int]) -> None:
    import psutil

    while server is not None:
        total = 0
        for pid in server.pids():
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                pass
        peak[0] = max(peak[0], total)
        if done.wait(0.25):
            return


def cache_counters(url: str, model: str) -> dict | None:
    """mlxgw's prefix-cache counters for `model` (None from a server without /v1/status)."""
    try:
        status_url = f"{url.removesuffix('/v1')}/v1/status"
        request = urllib.request.Request(status_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        with urllib.request.urlopen(request, timeout=10) as r:
            status = json.loads(r.read())
    except Exception:
        return None
    for m in status.get("models", []):
        if m.get("name") == model:
            caches = [w.get("stats", {}).get("cache") or {} for w in m.get("workers", [])]
            return {
                "prompt": sum(c.get("prompt_tokens", 0) for c in caches),
                "reused": sum(c.get("reused_tokens", 0) for c in caches),
                "disk": sum((c.get("disk_tier") or {}).get("tokens_brought_back", 0) for c in caches),
            }
    return None


def pct(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def per_turn(result: dict, turns: int) -> list[dict]:
    rows = result["rows"]
    table = []
    for turn in range(turns):
        done = [r for r in rows if r["turn"] == turn and "error" not in r]
        ttft = [r["ttft_s"] for r in done if r.get("ttft_s") is not None]
        prompt = sum(r["prompt_tokens"] or 0 for r in done if r.get("cached_tokens") is not None)
        cached = sum(r["cached_tokens"] for r in done if r.get("cached_tokens") is not None)
        decode = [r["decode_per_s"] for r in done if r.get("decode_per_s")]
        table.append(
            {
                "turn": turn + 1,
                "requests": len(done),
                "lost": sum(1 for r in rows if r["turn"] == turn and "error" in r),
                "ttft_p50_s": pct(ttft, 0.5),
                "ttft_p90_s": pct(ttft, 0.9),
                "ttft_p99_s": pct(ttft, 0.99),
                "decode_per_s_p50": pct(decode, 0.5),
                "cached_share": cached / prompt if prompt else None,
            }
        )
    tiers = result.get("tiers")
    if tiers and tiers["prompt"] and table:  # the whole round's, on its last row
        table[-1]["from_ram"] = (tiers["reused"] - tiers["disk"]) / tiers["prompt"]
        table[-1]["from_disk"] = tiers["disk"] / tiers["prompt"]
    if table:
        table[-1]["peak_rss_mb"] = (result.get("peak_rss_bytes") or 0) / 2**20 or None
    return table


def markdown(results: dict[str, list[list[dict]]]) -> str:
    header = (
        "server | round | turn | requests | lost | TTFT p50 / p90 / p99 (s) | decode/s p50 | cached | "
        "round: RAM / disk | peak RSS MB"
    )
    rows = []
    for server, rounds in results.items():
        for i, table in enumerate(rounds, 1):
            for t in table:
                ttft = " / ".join(or_dash(t[k]) for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s"))
                tiers = f"{or_dash(t.get('from_ram'), '{:.0%}')} / {or_dash(t.get('from_disk'), '{:.0%}')}"
                rows.append(
                    [
                        server,
                        i,
                        t["turn"],
                        t["requests"],
                        t["lost"],
                        ttft,
                        or_dash(t["decode_per_s_p50"], "{:.1f}"),
                        or_dash(t["cached_share"], "{:.0%}"),
                        tiers,
                        or_dash(t.get("peak_rss_mb"), "{:.0f}"),
                    ]
                )
    return markdown_table(header, rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path, nargs="?", help="a model folder (servers started here)")
    ap.add_argument("--url", help="a running server's /v1 URL instead")
    ap.add_argument("--model", default=None, help="the model name at --url")
    ap.add_argument("--mlx-lm", action="store_true", help="also mlx_lm.server")
    ap.add_argument("--vllm-python", default=None, help="also vllm-mlx, from this venv's python")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=2000)
    ap.add_argument("--own-words", type=int, default=1200)
    ap.add_argument("--turn-words", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--think-s", type=float, default=5.0, help="mean think time between turns")
    ap.add_argument("--cache-mb", type=int, default=None, help="every server's prefix-cache byte bound (MiB)")
    ap.add_argument("--no-disk", action="store_true", help="also mlxgw with its prefix store's disk tier off")
    ap.add_argument(
        "--cache-groups",
        action="store_true",
        help="also mlxgw with a key per session: each key its own cache namespace, and all in one group",
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    if not args.url and not args.model_dir:
        ap.error("a model folder or --url")
    return args


def spawn_servers(args: argparse.Namespace, home: Path) -> list[ServerProcess]:
    """mlxgw (and without its disk tier, --no-disk), mlx_lm.server and vllm-mlx on one model
    folder, each with the same prefix-cache byte bound when --cache-mb names one."""
    seqs = max(args.sessions, 8)
    cache = {} if args.cache_mb is None else {"prefix_memory_mb": args.cache_mb}
    out = [spawn_mlxgw(home / "mlxgw", registry(args.model_dir, max_num_seqs=seqs, cache=cache))]
    if args.no_disk:
        entry = registry(args.model_dir, max_num_seqs=seqs, cache={**cache, "prefix_disk_mb": 0})
        out.append(spawn_mlxgw(home / "mlxgw-nodisk", entry, label="mlxgw-nodisk"))
    if args.cache_groups:
        entry = registry(args.model_dir, max_num_seqs=seqs, cache=cache)
        for label, group in (("mlxgw-key-each", None), ("mlxgw-one-group", "team")):
            keys = ["--keys", str(keys_file(home / label / "keys.yaml", args.sessions, group))]
            out.append(spawn_mlxgw(home / label, entry, label=label, extra_args=keys))
    if args.mlx_lm:  # a prompt cache per session, so that no session evicts another's
        flags = ["--prompt-cache-size", str(max(10, args.sessions))]
        if args.cache_mb is not None:
            flags += ["--prompt-cache-bytes", str(args.cache_mb << 20)]
        out.append(spawn_mlx_lm(args.model_dir, home, flags))
    if args.vllm_python:  # its paged prefix cache and SSD tier on, as mlxgw's store
        flags = ["--use-paged-cache", "--ssd-cache-dir", str(home / "vllm-ssd")]
        if args.cache_mb is not None:
            flags += ["--cache-memory-mb", str(args.cache_mb)]
        out.append(spawn_vllm_mlx(args.vllm_python, args.model_dir, home, flags))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results: dict[str, list[list[dict]]] = {}
    raw: dict[str, list[list[dict]]] = {}
    servers = [("server", args.url, args.model or "default")] if args.url else []
    started: list[ServerProcess] = []
    with tempfile.TemporaryDirectory() as home:
        try:
            if not args.url:
                started += spawn_servers(args, Path(home))
                for server in started:
                    server.wait_ready()
                servers += [(s.label, s.api, s.model) for s in started]
            by_label = {s.label: s for s in started}
            for _, url, model in servers:
                warm_up(url, model, key=ADMIN_KEY)
            for r in range(args.rounds):
                for label, url, model in servers[r % len(servers) :] + servers[: r % len(servers)]:
                    result = study(url, model, args, args.seed + r, by_label.get(label))
                    raw.setdefault(label, []).append(result)
                    results.setdefault(label, []).append(per_turn(result, args.turns))
        finally:
            stop_all(started)
    table = markdown(results)
    print(table)
    if args.out:
        args.out.with_suffix(".json").write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": raw}, default=str)
        )
        args.out.with_suffix(".md").write_text(table + "\n")
    if any(t["lost"] for rounds in results.values() for table_ in rounds for t in table_):
        sys.exit(2)


if __name__ == "__main__":
    main()
