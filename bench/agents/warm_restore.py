"""Warm after unload: TTFT of a long shared prefix once the model was unloaded and loaded
again, cold (nothing stored) vs restored from the prefix cache's disk copy.

    python -m mlxgw.bench.agents.warm_restore --url http://127.0.0.1:8000 --model smollm2-135m

Each round takes a fresh prefix (distinct words, about 4k tokens with --prefix-words 3600)
and measures, on the same gateway and worker settings:
  cold      clear the prefix cache (memory and disk), unload, load, ask a question on it
  restored  unload (the stopping worker writes its hottest prefixes), load (the new worker
            reads them back), ask another question on the same prefix
  warm      ask a third question without unloading: the in-memory hit, the floor
Load time (until the worker is ready) and unload time (which includes the write) are
reported too. Unloading, loading and clearing need an admin key when keys are on."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import aiohttp

from ..loadgen import one_request, shared_prefix_prompts
from ..stats import median


async def _admin(session: aiohttp.ClientSession, method: str, url: str) -> float:
    started = time.perf_counter()
    async with session.request(method, url) as resp:
        if resp.status != 200:
            raise SystemExit(f"{method} {url}: {resp.status} {(await resp.text())[:300]}")
        await resp.read()
    return time.perf_counter() - started


async def _ask(session: aiohttp.ClientSession, url: str, model: str, messages: list[dict]) -> dict:
    r = await one_request(session, f"{url}/v1", model, messages, max_tokens=8, temperature=0.0, stream=True)
    if not r.ok or r.ttft is None:
        raise SystemExit(f"request failed: {r.status} {r.error}")
    return {"ttft_s": round(r.ttft, 3), "cached_tokens": r.cached_tokens}


async def _prompt_tokens(session: aiohttp.ClientSession, url: str, model: str, messages: list[dict]) -> int:
    async with session.post(f"{url}/tokenize", json={"model": model, "messages": messages}) as resp:
        return (await resp.json())["count"]


async def _disk_stats(session: aiohttp.ClientSession, url: str, model: str) -> dict:
    async with session.get(f"{url}/v1/cache/stats", params={"model": model}) as resp:
        workers = (await resp.json())["models"][model]
    return (workers[0] if workers else {}).get("disk") or {}


async def _model_load_s(session: aiohttp.ClientSession, url: str, model: str) -> float | None:
    """The worker's own model-load time (weights and tokenizer), as /v1/status reports it."""
    async with session.get(f"{url}/v1/status") as resp:
        models = (await resp.json())["models"]
    return next((m.get("load_seconds") for m in models if m["name"] == model), None)


async def one_round(session: aiohttp.ClientSession, url: str, model: str, words: int, seed: int) -> dict:
    cold_q, restored_q, warm_q = shared_prefix_prompts(3, words, seed=seed)
    unload, load = f"{url}/v1/models/{model}/unload", f"{url}/v1/models/{model}/load"
    out: dict = {"seed": seed}
    await _admin(session, "POST", load)
    out["prompt_tokens"] = await _prompt_tokens(session, url, model, cold_q)
    await _admin(session, "DELETE", f"{url}/v1/cache?model={model}")  # memory and disk
    out["cold_unload_s"] = round(await _admin(session, "POST", unload), 3)
    out["cold_load_s"] = round(await _admin(session, "POST", load), 3)
    out["cold_model_load_s"] = await _model_load_s(session, url, model)
    out["cold"] = await _ask(session, url, model, cold_q)
    out["restored_unload_s"] = round(await _admin(session, "POST", unload), 3)  # includes the write
    out["restored_load_s"] = round(await _admin(session, "POST", load), 3)
    out["restored_model_load_s"] = await _model_load_s(session, url, model)
    out["restored"] = await _ask(session, url, model, restored_q)
    out["disk"] = await _disk_stats(session, url, model)
    out["warm"] = await _ask(session, url, model, warm_q)
    return out


def summarize(rounds: list[dict]) -> dict:
    def median_ttft(variant: str) -> float:
        return median(r[variant]["ttft_s"] for r in rounds)

    cold, restored, warm = median_ttft("cold"), median_ttft("restored"), median_ttft("warm")
    return {
        "rounds": len(rounds),
        "prompt_tokens": rounds[0]["prompt_tokens"],
        "ttft_cold_s": cold,
        "ttft_restored_s": restored,
        "ttft_warm_in_memory_s": warm,
        "restored_vs_cold": round(cold / restored, 1) if restored else None,
        "restore_s": median(r["disk"].get("restore_s", 0.0) for r in rounds),
        "load_s_cold": median(r["cold_load_s"] for r in rounds),
        "load_s_restored": median(r["restored_load_s"] for r in rounds),
        "unload_s_nothing_to_write": median(r["cold_unload_s"] for r in rounds),
        "unload_s_with_write": median(r["restored_unload_s"] for r in rounds),
    }


async def run(url: str, model: str, words: int, rounds: int, api_key: str | None) -> dict:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        results = []
        for i in range(rounds):
            results.append(await one_round(session, url, model, words, seed=1000 + i))
            print(json.dumps(results[-1]), flush=True)
    return {"model": model, "prefix_words": words, "summary": summarize(results), "rounds": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefix-words", type=int, default=3600, help="about 4k tokens with SmolLM2's tokenizer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--api-key", default=None, help="an admin key, when keys are on")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = ap.parse_args()
    report = asyncio.run(run(args.url.rstrip("/"), args.model, args.prefix_words, args.rounds, args.api_key))
    print(json.dumps(report["summary"], indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
