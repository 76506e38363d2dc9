"""A sharded model against the same model in one process, through one running gateway:
decode tokens/s (the two take turns in each round, order rotated, under bench/method.py:
median and every round, the ratio paired within rounds) and memory per rank.

    python -m mlxgw.bench.serving.sharded --url http://127.0.0.1:8000 --one qwen-one --sharded qwen-pipe \
        --concurrency 1,4 --rounds 3 --max-tokens 32

Both names must be models.yaml entries of the same folder, one with `distributed:`."""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from .. import method as bench_method
from ..stats import paired_ratios, summarize

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
    bench_method.add_arguments(ap)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    method = bench_method.from_args(args)
    models = (args.one, args.sharded)
    for m in models:  # load both, and warm up
        one_round(args.url, m, 1, 4)
    results: dict = {"tokens_per_s": {}, "memory": {}}
    levels = [int(x) for x in args.concurrency.split(",")]
    runs: dict[int, dict[str, list[float]]] = {c: {m: [] for m in models} for c in levels}
    with method.busy_loops():
        for _, order in method.each_round(models):
            for c in levels:
                for m in order:  # alternate, rotated: a noisy machine slows both alike
                    runs[c][m].append(round(one_round(args.url, m, c, args.max_tokens), 2))
    for c in levels:
        results["tokens_per_s"][c] = runs[c]
        rates = {m: summarize(v) for m, v in runs[c].items()}
        ratio = summarize(paired_ratios(runs[c][args.sharded], runs[c][args.one]))
        method.check(f"c={c} sharded / one process", ratio)
        print(f"concurrency {c}: " + ", ".join(f"{m} {rates[m].cell()} tok/s" for m in models))
        print(f"  sharded / one process, per round: {ratio.cell()} ({method.flag_cell(ratio)})")
    for m in models:
        results["memory"][m] = memory(args.url, m)
        print(f"memory {m}: {results['memory'][m]}")
    results["method"] = method.as_dict()
    print(json.dumps(results))
    raise SystemExit(method.finish())


if __name__ == "__main__":
    main()
