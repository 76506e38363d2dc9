"""The `mlxgw bench` workflow: concurrency sweep (optionally against other servers, alternated
and rotated round by round under bench/method.py), shared-prefix workload, JSON and Markdown
output with every round beside its median."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from .loadgen import one_request, run_level, shared_prefix_prompts, varied_prompts
from .method import Method
from .progress import LevelProgress
from .report import (
    levels_markdown,
    merge_rounds,
    paired_ratio_rows,
    percentile,
    ratios_markdown,
    summarize_level,
)
from .stats import summarize


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
    rounds: int = 3  # the whole sweep this many times, the servers' order rotated each round


async def _clear_cache(target: Target) -> None:
    """mlxgw only; a peer without the route just answers 404."""
    try:
        async with aiohttp.ClientSession() as s:
            await s.delete(f"{target.url.rstrip('/').removesuffix('/v1')}/v1/cache")
    except aiohttp.ClientError:
        pass


async def sweep(targets: list[Target], cfg: BenchConfig, method: Method, log=print) -> list[dict]:
    """Every level for every server, alternated: within a level the servers take turns on
    the same prompts, and each round rotates who goes first (bench/method.py), so drift in
    the machine's state (thermal, other load) lands on everyone alike."""
    rows = []
    for rnd, order in method.each_round(targets, label=lambda t: t.label, log=log):
        for level, c in enumerate(cfg.concurrency):
            n = cfg.requests or max(4, 2 * c)
            prompts = (
                varied_prompts(1, cfg.prompt_words, cfg.seed) * n
                if cfg.fixed_prompt
                else varied_prompts(n, cfg.prompt_words, cfg.seed + 1000 * level + 100_000 * rnd, cfg.prompt_words_max)
            )
            for t in order:
                row = await _level(t, cfg, c, n, prompts, f"round {rnd + 1}/{method.rounds} level {level + 1}")
                row["round"] = rnd + 1
                rows.append(row)
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
    return {"server": t.label, "concurrency": c, **summarize_level(results, wall)}


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


def shared_prefix_rounds(targets: list[Target], cfg: BenchConfig, method: Method) -> list[dict]:
    """The shared-prefix workload once per round and server (cache cleared each time, order
    rotated): per server, the median cold/warm TTFT and speedup with every round."""
    runs: dict[str, list[dict]] = {t.label: [] for t in targets}
    rounds = dataclasses.replace(method, logs=[], unstable=[])  # its own round lines, not the sweep's
    for _, order in rounds.each_round(targets, label=lambda t: t.label, log=lambda line: None):
        for t in order:
            runs[t.label].append(asyncio.run(shared_prefix(t, cfg)))
    out = []
    for label, rs in runs.items():
        speedup = summarize([r["speedup"] for r in rs])
        method.check(f"shared prefix {label} speedup", speedup)  # flagged on the run itself
        out.append(
            {
                **rs[-1],
                "cold_ttft_s": summarize([r["cold_ttft_s"] for r in rs]).median,
                "warm_ttft_p50_s": summarize([r["warm_ttft_p50_s"] for r in rs]).median,
                "speedup": speedup.median,
                "speedup_rounds": list(speedup.rounds),
                "failed": sum(r["failed"] for r in rs),
            }
        )
    return out


def run(targets: list[Target], cfg: BenchConfig, out: Path | None, log=print, method: Method | None = None) -> dict:
    """The sweep (and the shared-prefix workload) under `method`, with its busy loops
    running throughout; report["exit_status"] is UNSTABLE_EXIT when rounds disagree."""
    method = method or Method(rounds=cfg.rounds)
    report = {
        "config": cfg.__dict__,
        "targets": [t.__dict__ for t in targets],
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with method.busy_loops():
        report["runs"] = asyncio.run(sweep(targets, cfg, method, log))
        if cfg.prefix_words:
            report["shared_prefix"] = shared_prefix_rounds(targets, cfg, method)
    report["levels"] = merge_rounds(report["runs"], method)
    first = targets[0].label
    report["ratios"] = {t.label: paired_ratio_rows(report["runs"], first, t.label, method) for t in targets[1:]}
    report["method"] = method.as_dict()
    report["markdown"] = _markdown(report, method, first)
    report["exit_status"] = method.finish()
    report["method"]["unstable"] = list(method.unstable)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=2))
        out.with_suffix(".md").write_text(report["markdown"] + "\n")
    return report


def _markdown(report: dict, method: Method, first: str) -> str:
    md = [f"({method.header()})\n", levels_markdown(report["levels"])]
    for peer, rows in report["ratios"].items():
        md.append("\n" + ratios_markdown(first, peer, rows))
    for sp in report.get("shared_prefix", []):
        md.append(
            f"\nshared prefix ({sp['prefix_words']} words) on {sp['server']}: cold TTFT "
            f"{sp['cold_ttft_s']} s, warm TTFT p50 {sp['warm_ttft_p50_s']} s, x{sp['speedup']} "
            f"(medians; speedup by round: {', '.join(f'{v:.1f}' for v in sp['speedup_rounds'])})"
        )
    md.append("")
    md += [log.line() for log in method.logs]
    if method.unstable:
        share = f"{method.max_spread:.0%}"
        md.append(f"\n**UNSTABLE: {len(method.unstable)} figure(s) vary across rounds by more than {share}**")
        md += [f"- {line}" for line in method.unstable]
    return "\n".join(md)
