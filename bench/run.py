"""The `mlxgw bench` workflow: concurrency sweep (optionally against a second server,
alternating), shared-prefix workload, JSON and Markdown output."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from .loadgen import one_request, run_level, shared_prefix_prompts, varied_prompts
from .progress import LevelProgress
from .report import markdown, percentile, summarize


@dataclass
class Target:
    label: str
    url: str  # base URL including /v1
    model: str
    api_key: str | None = None


@dataclass
class BenchConfig:
    concurrency: list[int]
    requests: int  # per level; default: 2 x concurrency, at least 4
    max_tokens: int
    prompt_words: int
    prompt_words_max: int | None  # sample lengths in [prompt_words, prompt_words_max]
    temperature: float
    stream: bool
    fixed_prompt: bool
    prefix_words: int  # 0: skip the shared-prefix workload
    prefix_repeats: int
    seed: int
    rounds: int = 1  # the whole sweep this many times, the servers' order rotated each round


async def _clear_cache(target: Target) -> None:
    """mlxgw only; a peer without the route just answers 404."""
    try:
        async with aiohttp.ClientSession() as s:
            await s.delete(f"{target.url.rstrip('/').removesuffix('/v1')}/v1/cache")
    except aiohttp.ClientError:
        pass


async def sweep(targets: list[Target], cfg: BenchConfig, log=print) -> list[dict]:
    """Every level for every server, alternated: within a level the servers take turns on
    the same prompts, and each round rotates who goes first, so drift in the machine's
    state (thermal, other load) lands on everyone alike."""
    rows = []
    for rnd in range(cfg.rounds):
        order = targets[rnd % len(targets) :] + targets[: rnd % len(targets)]
        for level, c in enumerate(cfg.concurrency):
            n = cfg.requests or max(4, 2 * c)
            prompts = (
                varied_prompts(1, cfg.prompt_words, cfg.seed) * n
                if cfg.fixed_prompt
                else varied_prompts(n, cfg.prompt_words, cfg.seed + 1000 * level + 100_000 * rnd, cfg.prompt_words_max)
            )
            for t in order:
                rows.append(await _level(t, cfg, c, n, prompts, f"round {rnd + 1}/{cfg.rounds} level {level + 1}"))
                rows[-1]["round"] = rnd + 1
                row = rows[-1]
                log(
                    f"{t.label:>14} c={c:<3} ok={row['completed']:<4} failed={row['failed']:<3} "
                    f"tok/s={row['output_tok_s']:<8} TTFT p50={row['ttft_p50_s']} s"
                )
    return rows


async def _level(t: Target, cfg: BenchConfig, c: int, n: int, prompts: list[str], title: str) -> dict:
    progress = LevelProgress(f"{title} {t.label} c={c}", n)
    results, wall = await run_level(
        t.url,
        t.model,
        prompts,
        c,
        max_tokens=cfg.max_tokens,
        temperature=cfg.temperature,
        stream=cfg.stream,
        api_key=t.api_key,
        on_result=progress.update,
    )
    progress.close()
    return {"server": t.label, "concurrency": c, **summarize(results, wall)}


def medians(rows: list[dict]) -> list[dict]:
    """One row per (server, concurrency): the median over rounds of each figure."""
    if not any(r.get("round", 1) > 1 for r in rows):
        return rows
    keys = (
        "output_tok_s",
        "requests_s",
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "itl_p50_s",
        "itl_p99_s",
        "itl_max_s",
    )
    out: list[dict] = []
    for r in rows:
        if any(o["server"] == r["server"] and o["concurrency"] == r["concurrency"] for o in out):
            continue
        same = [x for x in rows if x["server"] == r["server"] and x["concurrency"] == r["concurrency"]]
        merged = {**r, "rounds": len(same)}
        merged["completed"] = sum(x["completed"] for x in same)
        merged["failed"] = sum(x["failed"] for x in same)
        merged["output_tokens"] = sum(x["output_tokens"] for x in same)
        for k in keys:
            values = [x[k] for x in same if x.get(k) is not None]
            merged[k] = round(percentile(values, 50), 4) if values else None
        merged.pop("round", None)
        out.append(merged)
    return out


async def shared_prefix(target: Target, cfg: BenchConfig) -> dict:
    """Cold request (cache cleared) vs. repeats that share a long prefix, sequentially."""
    await _clear_cache(target)
    prompts = shared_prefix_prompts(cfg.prefix_repeats + 1, cfg.prefix_words, cfg.seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        results = [
            await one_request(s, target.url, target.model, p, max_tokens=8, temperature=0.0, stream=True)
            for p in prompts
        ]
    cold, warm = results[0], [r for r in results[1:] if r.ok and r.ttft]
    warm_p50 = percentile([r.ttft for r in warm], 50)
    return {
        "server": target.label,
        "prefix_words": cfg.prefix_words,
        "cold_ttft_s": round(cold.ttft, 4) if cold.ttft else None,
        "warm_ttft_p50_s": round(warm_p50, 4) if warm_p50 else None,
        "speedup": round(cold.ttft / warm_p50, 2) if cold.ttft and warm_p50 else None,
        "warm_cached_tokens": [r.cached_tokens for r in warm],
        "failed": sum(1 for r in results if not r.ok),
    }


def ratios(rows: list[dict], a: str, b: str) -> list[dict]:
    out = []
    for ra in (r for r in rows if r["server"] == a):
        rb = next((r for r in rows if r["server"] == b and r["concurrency"] == ra["concurrency"]), None)
        if rb is None:
            continue

        def ratio(k, invert=False, ra=ra, rb=rb):
            x, y = ra.get(k), rb.get(k)
            if not x or not y:
                return None
            return round(y / x if invert else x / y, 2)

        out.append(
            {
                "concurrency": ra["concurrency"],
                "tok_s_ratio": ratio("output_tok_s"),
                "ttft_p50_ratio": ratio("ttft_p50_s", invert=True),
            }
        )
    return out


def run(targets: list[Target], cfg: BenchConfig, out: Path | None, log=print) -> dict:
    report = {
        "config": cfg.__dict__,
        "targets": [t.__dict__ for t in targets],
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    report["runs"] = asyncio.run(sweep(targets, cfg, log))
    report["levels"] = medians(report["runs"])
    report["ratios"] = {t.label: ratios(report["levels"], targets[0].label, t.label) for t in targets[1:]}
    if cfg.prefix_words:
        report["shared_prefix"] = [asyncio.run(shared_prefix(t, cfg)) for t in targets]
    md = [markdown(report["levels"])]
    if cfg.rounds > 1:
        md.insert(0, f"(median of {cfg.rounds} rounds, servers alternated)\n")
    for peer, rows in report["ratios"].items():
        md.append(
            f"\n| c | {targets[0].label} / {peer} tok/s | TTFT p50 ratio (higher = {targets[0].label} "
            "is faster) |\n|---|---|---|"
        )
        md += [f"| {r['concurrency']} | {r['tok_s_ratio']} | {r['ttft_p50_ratio']} |" for r in rows]
    for sp in report.get("shared_prefix", []):
        md.append(
            f"\nshared prefix ({sp['prefix_words']} words) on {sp['server']}: cold TTFT "
            f"{sp['cold_ttft_s']} s, warm TTFT p50 {sp['warm_ttft_p50_s']} s, x{sp['speedup']}"
        )
    report["markdown"] = "\n".join(md)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=2))
        out.with_suffix(".md").write_text(report["markdown"] + "\n")
    return report
