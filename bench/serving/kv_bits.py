"""Quantized KV through the server: memory per token, tok/s at concurrency c and greedy
agreement with the plain cache, for kv_bits 16 (the model's dtype), 8 and 4.

    python -m mlxgw.bench.serving.kv_bits ~/.cache/mlxgw/models/smollm2-135m --concurrency 8 --rounds 3

One `mlxgw up` serves the folder three times (`kv16`, `kv8`, `kv4`), all loaded, with the same
rows. Under bench/method.py (3 rounds by default, the variants' order rotated each round, load
recorded per round, `--busy N`, exit 3 when a variant's tok/s rounds disagree by more than
--max-spread) each variant runs the same distinct prompts, greedy and streaming, with its
prefix cache emptied first. Reported per variant: KV bytes per token as the worker states it
(`stats.kv_bytes_per_token`) and as measured (the prefix cache's bytes after one prompt of
known length, over its tokens), tok/s (median, every round) and its ratio to kv16 paired within
rounds, and how many requests' greedy text equals kv16's in the same round."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import urllib.request
from pathlib import Path

from .. import method as bench_method
from ..loadgen import run_level, varied_prompts
from ..method import Method
from ..report import markdown_table
from ..servers import ServerProcess, show_log_tails, spawn_mlxgw, stop_all, warm_up
from ..speculation.matrix import clear_cache
from ..stats import paired_ratios, summarize

VARIANTS = {"kv16": None, "kv8": 8, "kv4": 4}


def start_gateway(model_dir: Path, home: Path, rows: int) -> ServerProcess:
    models = [
        {"name": name, "source": str(model_dir), "preload": True, "max_num_seqs": rows, "cache": {"kv_bits": bits}}
        for name, bits in VARIANTS.items()
    ]
    config = {"manager": {"auto_discover": False, "max_loaded_models": len(models)}, "models": models}
    return spawn_mlxgw(home, config)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def stated_bytes_per_token(url: str, variant: str) -> int | None:
    for model in _get(f"{url}/status").get("models", []):
        if model.get("name") == variant:
            for worker in model.get("workers", []):
                return (worker.get("stats") or {}).get("kv_bytes_per_token")
    return None


def measured_bytes_per_token(url: str, variant: str, words: int) -> float | None:
    """The prefix cache's bytes after one cold prompt, over that prompt's tokens (the entry
    it stores; one generated token beside a few hundred prompt tokens hardly moves it)."""
    clear_cache(url)
    body = {"model": variant, "prompt": varied_prompts(1, words, 7)[0][0]["content"], "max_tokens": 1}
    req = urllib.request.Request(f"{url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        tokens = json.loads(r.read())["usage"]["prompt_tokens"]
    stats = _get(f"{url}/cache/stats?model={variant}")
    nbytes = _find(stats.get("models", {}).get(variant), "bytes")  # {"models": {name: [per worker]}}
    return round(nbytes / tokens, 1) if nbytes and tokens else None


def _find(tree, key: str):
    """The first `key` in a nested reply (the cache statistics nest per model and worker)."""
    if isinstance(tree, dict):
        if key in tree and isinstance(tree[key], int | float):
            return tree[key]
        for value in tree.values():
            found = _find(value, key)
            if found is not None:
                return found
    if isinstance(tree, list):
        for value in tree:
            found = _find(value, key)
            if found is not None:
                return found
    return None


def level(url: str, variant: str, prompts: list[list[dict]], c: int, max_tokens: int) -> dict:
    clear_cache(url)
    results, wall = asyncio.run(
        run_level(url, variant, prompts, c, max_tokens=max_tokens, temperature=0.0, timeout_s=1800)
    )
    ok = [r for r in results if r.ok]
    return {
        "failed": len(results) - len(ok),
        "tok_s": round(sum(r.tokens for r in ok) / wall, 3) if wall else None,
        "texts": {r.index: r.text for r in ok},
    }


def sweep(url: str, args, method: Method) -> list[dict]:
    prompts = varied_prompts(args.requests, 40, args.seed)
    runs = []
    for rnd, order in method.each_round(list(VARIANTS)):
        for variant in order:
            row = level(url, variant, prompts, args.concurrency, args.max_tokens)
            runs.append({"round": rnd + 1, "variant": variant, **row})
            print(f"round {rnd + 1} {variant}: tok/s {row['tok_s']} failed {row['failed']}", flush=True)
    return runs


def table(runs: list[dict], memory: dict, method: Method) -> str:
    header = (
        "kv | KV bytes/token stated | measured | vs kv16 | tok/s (rounds) | spread | / kv16, paired (rounds) | "
        "greedy text = kv16 | failed"
    )
    rows = []
    base = sorted((r for r in runs if r["variant"] == "kv16"), key=lambda r: r["round"])
    for variant in VARIANTS:
        mine = sorted((r for r in runs if r["variant"] == variant), key=lambda r: r["round"])
        rate = summarize([r["tok_s"] for r in mine])
        method.check(f"{variant} tok/s", rate)
        ratio = summarize(paired_ratios([r["tok_s"] for r in mine], [r["tok_s"] for r in base]))
        agree = sum(1 for a, b in zip(mine, base) for i, t in a["texts"].items() if b["texts"].get(i) == t)
        total = sum(len(r["texts"]) for r in mine)
        stated, measured = memory[variant]
        share = f"{measured / memory['kv16'][1]:.2f}x" if measured and memory["kv16"][1] else ""
        failed = sum(r["failed"] for r in mine)
        rows.append(
            [
                variant,
                stated,
                measured,
                share,
                rate.cell(),
                method.flag_cell(rate),
                ratio.cell(3),
                f"{agree}/{total}",
                failed,
            ]
        )
    return markdown_table(header, rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16, help="per variant and round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--memory-words", type=int, default=300, help="the prompt that measures bytes per token")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    bench_method.add_arguments(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    method = bench_method.from_args(args)
    # A timeout's SIGTERM must still stop the servers this bench started (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model_dir = args.model_dir.expanduser().resolve()
    with tempfile.TemporaryDirectory(prefix="mlxgw-kvbits-") as tmp:
        server = start_gateway(model_dir, Path(tmp), args.concurrency)
        url = server.api
        try:
            server.wait_ready()
            for variant in VARIANTS:
                warm_up(url, variant)
            memory = {
                v: (stated_bytes_per_token(url, v), measured_bytes_per_token(url, v, args.memory_words))
                for v in VARIANTS
            }
            with method.busy_loops():
                runs = sweep(url, args, method)
        except Exception:
            show_log_tails([server])
            raise
        finally:
            stop_all([server])
    md = table(runs, memory, method)
    head = f"({method.header()}; c={args.concurrency}, {args.requests} requests, greedy, {args.max_tokens} tokens)"
    md = f"{head}\n\n{md}\n\n" + "\n".join(x.line() for x in method.logs)
    print(md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"method": method.as_dict(), "memory": memory, "runs": runs}
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
        args.out.with_suffix(".md").write_text(md + "\n")
    sys.exit(1 if any(r["failed"] for r in runs) else method.finish())


if __name__ == "__main__":
    main()
