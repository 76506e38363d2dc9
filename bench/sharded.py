"""A sharded model against the same model in one process, through one running gateway:
decode tokens/s (alternating the two within each round) and memory per rank.

    python -m mlxgw.bench.sharded --url http://127.0.0.1:8000 --one qwen-one --sharded qwen-pipe \
        --concurrency 1,4 --rounds 3 --max-tokens 32

Both names must be models.yaml entries of the same folder, one with `distributed:`."""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash map is.",
    "List five uses of copper.",
    "Describe a sunrise in the mountains.",
    "Summarise the rules of chess.",
    "What makes bread rise?",
    "Give three tips for writing tests.",
    "Why is the sky blue?",
]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.load(r)


def _status(url: str, model: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/status", timeout=60) as r:
        models = json.load(r)["models"]
    workers = next(m for m in models if m["name"] == model)["workers"]
    return workers[0]["stats"] if workers else {}


def one_round(url: str, model: str, concurrency: int, max_tokens: int) -> float:
    """Aggregate completion tokens/s of `concurrency` requests sent at once."""

    def ask(i: int) -> int:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "logit_bias": {"0": -100, "2": -100},  # SmolLM2/ChatML ends: keep generating
        }
        return _post(f"{url}/v1/chat/completions", body)["usage"]["completion_tokens"]

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(ask, range(concurrency)))
    return tokens / (time.perf_counter() - started)


def memory(url: str, model: str) -> dict:
    s = _status(url, model)
    return {
        "rss_bytes": s.get("rss_bytes"),
        "rank_rss_bytes": s.get("rank_rss_bytes"),
        "rank_param_bytes": s.get("rank_param_bytes"),
        "mlx_active_bytes": s.get("mlx_active_bytes"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--one", required=True, help="the unsharded entry")
    ap.add_argument("--sharded", required=True, help="the sharded entry of the same model")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    models = (args.one, args.sharded)
    for m in models:  # load both, and warm up
        one_round(args.url, m, 1, 4)
    results: dict = {"tokens_per_s": {}, "memory": {}}
    for c in [int(x) for x in args.concurrency.split(",")]:
        runs: dict[str, list[float]] = {m: [] for m in models}
        for _ in range(args.rounds):
            for m in models:  # alternate: a noisy machine slows both alike
                runs[m].append(round(one_round(args.url, m, c, args.max_tokens), 2))
        results["tokens_per_s"][c] = runs
        best = {m: max(v) for m, v in runs.items()}
        print(f"concurrency {c}: " + ", ".join(f"{m} {best[m]:.2f} tok/s (runs {runs[m]})" for m in models))
        print(f"  sharded / one process: {best[args.sharded] / best[args.one]:.2f}")
    for m in models:
        results["memory"][m] = memory(args.url, m)
        print(f"memory {m}: {results['memory'][m]}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
