"""A team's agent sessions over N local replicas of one model, per routing policy.

The team study (bench/team/sessions.py: a shared system prompt, each session's own context,
turns after think times, answers appended) against `mlxgw up` with `routing: {replicas: N}`
and each policy in turn:
- `prefix`: the replica holding the longest prefix, sessions placed by their first turn;
- `prefix+header`: the same with the client's session id sent (`x-session-affinity`, as
  crush sends it; Claude Code and Qwen Code send their own headers, read alike);
- `load`: the least loaded replica (what remote workers got before replicas);
- `round_robin`: the next replica in turn (nginx in front of several servers).
Per policy: warm turns' (turn 2 on) TTFT p50 / p90, the share of their prompt tokens read
from cache, the requests per replica against the mean (from /v1/status: the busiest
replica's share over the mean; 1.0 is even) and requests lost. The replicas share this
machine's cores and memory: on one host they trade each other's compute, so the study
measures where prefixes are found, not the throughput N Macs would add.

    python -m mlxgw.bench.team.replicas ~/.cache/mlxgw/models/qwen-coder --replicas 2,4 \\
        --sessions 16 --turns 4 --rounds 3 [--out replicas]

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
from ..servers import registry, spawn_mlxgw, stop_all, warm_up
from .sessions import pct, stream_chat, text

POLICIES = ("prefix", "prefix+header", "load", "round_robin")


def run_session(k: int, api: str, model: str, args: argparse.Namespace, seed: int, header: bool, out: list) -> None:
    rng = random.Random(seed * 1000 + k)
    messages = [{"role": "system", "content": f"You are coding agent {seed}. " + text(random.Random(seed), 400)}]
    context = f"Repository {k}: " + text(rng, args.own_words)
    extra = {"x-session-affinity": f"bench-session-{seed}-{k}"} if header else None
    for turn in range(args.turns):
        if turn:
            time.sleep(rng.expovariate(1 / args.think_s) if args.think_s > 0 else 0)
        messages.append({"role": "user", "content": (context + "\n\n" if turn == 0 else "") + text(rng, 60)})
        row = {"session": k, "turn": turn}
        try:
            row |= stream_chat(api, model, messages, args.max_tokens, args.timeout_s, headers=extra)
        except Exception as e:  # a lost request is a result, never a crash of the study
            out.append(row | {"error": f"{type(e).__name__}: {e}"[:200]})
            return
        messages.append({"role": "assistant", "content": row.pop("text")})
        out.append(row)


def replica_counts(api: str, model: str) -> list[int]:
    with urllib.request.urlopen(f"{api.removesuffix('/v1')}/v1/status", timeout=10) as r:
        status = json.loads(r.read())
    m = next(m for m in status["models"] if m["name"] == model)
    return [sum(r.get(f"routed_by_{how}", 0) for how in ("prefix", "session", "load")) for r in m["replicas"]]


def study(api: str, model: str, args: argparse.Namespace, seed: int, header: bool) -> dict:
    rows: list[dict] = []
    before = replica_counts(api, model)
    threads = [
        threading.Thread(target=run_session, args=(k, api, model, args, seed, header, rows))
        for k in range(args.sessions)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = [a - b for a, b in zip(replica_counts(api, model), before)]
    warm = [r for r in rows if r["turn"] > 0 and "error" not in r]
    prompt = sum(r.get("prompt_tokens") or 0 for r in warm)
    mean = sum(counts) / len(counts) if counts else 0
    return {
        "warm_ttft_p50_s": pct([r["ttft_s"] for r in warm if r.get("ttft_s")], 0.5),
        "warm_ttft_p90_s": pct([r["ttft_s"] for r in warm if r.get("ttft_s")], 0.9),
        "warm_cached": sum(r.get("cached_tokens") or 0 for r in warm) / prompt if prompt else None,
        "busiest_over_mean": max(counts) / mean if mean else None,
        "per_replica": counts,
        "lost": sum(1 for r in rows if "error" in r),
    }


def markdown(results: list[dict]) -> str:
    header = "replicas | policy | round | warm TTFT p50 / p90 (s) | warm prompt from cache | busiest / mean | lost"
    rows = (
        [
            r["replicas"],
            r["policy"],
            r["round"],
            f"{or_dash(r['warm_ttft_p50_s'])} / {or_dash(r['warm_ttft_p90_s'])}",
            or_dash(r["warm_cached"], "{:.0%}"),
            or_dash(r["busiest_over_mean"]),
            r["lost"],
        ]
        for r in results
    )
    return markdown_table(header, rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path, help="a model folder")
    ap.add_argument("--replicas", default="2,4", help="comma-separated replica counts")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--own-words", type=int, default=1200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--think-s", type=float, default=2.0, help="mean think time between turns")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="per replica")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results: list[dict] = []
    for n in [int(x) for x in args.replicas.split(",")]:
        for policy in args.policies.split(","):
            routing = {"replicas": n, "policy": policy.removesuffix("+header")}
            # the disk tier off: a turn that misses RAM is read again, as on another Mac
            cache = {"prefix_disk_mb": 0}
            entry = registry(args.model_dir, max_num_seqs=args.max_num_seqs, routing=routing, cache=cache)
            with tempfile.TemporaryDirectory() as home:
                server = spawn_mlxgw(Path(home), entry, label=f"mlxgw-{n}-{policy}")
                try:
                    server.wait_ready()
                    warm_up(server.api, server.model)
                    for r in range(args.rounds):  # every round's prompts are new
                        row = study(server.api, server.model, args, args.seed + r, policy.endswith("+header"))
                        results.append({"replicas": n, "policy": policy, "round": r + 1, **row})
                        print(markdown(results[-1:]).splitlines()[-1], flush=True)
                finally:
                    stop_all([server])
    table = markdown(results)
    print(table)
    if args.out:
        saved = {"args": vars(args) | {"out": str(args.out)}, "rows": results}
        args.out.with_suffix(".json").write_text(json.dumps(saved, default=str))
        args.out.with_suffix(".md").write_text(table + "\n")
    if any(r["lost"] for r in results):
        sys.exit(2)


if __name__ == "__main__":
    main()
