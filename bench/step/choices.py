"""What logprobs and n > 1 cost, measured on the worker's own scheduler and MLX runner
in-process (no HTTP, no IPC, so only the engine's work is timed):

- a batch of 8 greedy requests, without logprobs and with one of them asking for
  logprobs + 20 alternatives (the other 7 must not pay: same tokens, same time; their mean
  end time is reported beside the batch's). A row with logprobs does not speculate
  (worker/model/speculation/speculative.py), so with speculation on the batch's wall time is that row's;
  `--no-speculation` measures the logprobs alone;
- one request with n=4 against four separate requests with the same prompt (prompt tokens
  computed, and wall time);
- prompt logprobs (Completions' echo + logprobs: one extra forward pass over the prompt):
  one request alone with and without them, and a batch of 8 where one asks.

The variants of each figure alternate within every round (shared hosts are noisy).

    python -m mlxgw.bench.step.choices MODEL_DIR --max-tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import time

from ..stats import mean, median


def _runner(model_dir: str, speculation: bool = True):
    from ...shared.model_sections import SpeculativeConfig
    from ...worker.process.build_mlx import build_mlx_runner

    return build_mlx_runner(
        model_dir,
        context_length=None,
        max_num_seqs=8,
        prefill_step_size=512,
        cache_bytes=1 << 30,
        speculative=SpeculativeConfig(mode="prompt_lookup" if speculation else "off"),
    )


def _run(scheduler, reqs, finished_at: dict[str, float] | None = None) -> tuple[float, int]:
    """Submit, step until every request ended; (seconds, completion tokens). finished_at,
    when given, gets each request's seconds from the start to its end."""
    from ...shared.events import EventKind, Usage

    started = time.perf_counter()
    pending = {r.rid for r in reqs}
    tokens = 0
    for r in reqs:
        scheduler.submit(r)
    while pending:
        for rid, ev in scheduler.step():
            if ev.KIND in (EventKind.FINISH, EventKind.ERROR) and rid in pending:
                pending.discard(rid)
                tokens += (ev.usage or Usage()).completion_tokens
                if finished_at is not None:
                    finished_at[rid] = time.perf_counter() - started
    return time.perf_counter() - started, tokens


def _requests(
    tag: str,
    prompts: list[str],
    max_tokens: int,
    logprobs: list[int | None],
    n: int = 1,
    prompt_logprobs: list[int | None] | None = None,
) -> list:
    from ...shared import protocol as p

    prompt_logprobs = prompt_logprobs or [None] * len(prompts)
    return [
        p.GenerateRequest(
            rid=f"{tag}-{i}",
            messages=[{"role": "user", "content": text}],
            sampling=p.SamplingParams(temperature=0.0 if n == 1 else 0.8, seed=None if n == 1 else 1 + i),
            max_tokens=max_tokens,
            logprobs=lp,
            n=n,
            prompt_logprobs=plp,
        )
        for i, (text, lp, plp) in enumerate(zip(prompts, logprobs, prompt_logprobs))
    ]


def logprobs_cost(scheduler, max_tokens: int, rounds: int) -> dict:
    from ..loadgen import varied_prompts

    prompts = [m[0]["content"] for m in varied_prompts(8, 40, seed=0)]
    times: dict[str, list[float]] = {"without": [], "with_one": []}
    others: dict[str, list[float]] = {"without": [], "with_one": []}  # mean end of requests 1-7
    tokens: dict[str, int] = {}
    _run(scheduler, _requests("warm", prompts[:2], 4, [None, 5]))
    for r in range(rounds):
        for name, lps in (("without", [None] * 8), ("with_one", [20] + [None] * 7)):
            scheduler.runner.cache_clear()
            ends: dict[str, float] = {}
            wall, n = _run(scheduler, _requests(f"{name}{r}", prompts, max_tokens, lps), ends)
            times[name].append(wall)
            others[name].append(mean(ends[f"{name}{r}-{i}"] for i in range(1, 8)))
            tokens[name] = n
    return {
        "batch": 8,
        "max_tokens": max_tokens,
        "speculation": scheduler.runner.speculator.enabled,
        "completion_tokens": tokens,
        "median_wall_s": {k: round(median(v), 3) for k, v in times.items()},
        "others_mean_end_s": {k: round(median(v), 3) for k, v in others.items()},
        "wall_s_by_round": {k: [round(x, 2) for x in v] for k, v in times.items()},
        "tok_s": {k: round(tokens[k] / median(v), 1) for k, v in times.items()},
    }


def choices_cost(scheduler, max_tokens: int, rounds: int) -> dict:
    from ..loadgen import varied_prompts

    prompt = varied_prompts(1, 300, seed=1)[0][0]["content"]
    out: dict[str, list] = {"n4": [], "four_requests": []}
    prefilled: dict[str, int] = {}
    for r in range(rounds):
        for name in out:
            scheduler.runner.cache_clear()
            before = scheduler.prefilled_tokens
            if name == "n4":
                reqs = _requests(f"n4-{r}", [prompt], max_tokens, [None], n=4)
            else:
                reqs = [_requests(f"four-{r}-{i}", [prompt], max_tokens, [None], n=1)[0] for i in range(4)]
                for i, req in enumerate(reqs):
                    req.rid, req.sampling.temperature, req.sampling.seed = f"four-{r}-{i}", 0.8, 1 + i
            wall, _ = _run(scheduler, reqs)
            out[name].append(wall)
            prefilled[name] = scheduler.prefilled_tokens - before
    return {
        "prompt_words": 300,
        "max_tokens": max_tokens,
        "prompt_tokens_computed": prefilled,
        "median_wall_s": {k: round(median(v), 3) for k, v in out.items()},
        "wall_s_by_round": {k: [round(x, 2) for x in v] for k, v in out.items()},
    }


def prompt_logprobs_cost(scheduler, max_tokens: int, rounds: int) -> dict:
    """Prompt logprobs cost one forward pass over the prompt, outside the batch's prefill:
    alone (300-word prompt) and in a batch of 8 (one of them asking, 5 alternatives)."""
    from ..loadgen import varied_prompts

    long_prompt = varied_prompts(1, 300, seed=2)[0][0]["content"]
    batch = [m[0]["content"] for m in varied_prompts(8, 300, seed=3)]
    variants = {
        "alone_without": lambda tag: _requests(tag, [long_prompt], max_tokens, [0]),
        "alone_with": lambda tag: _requests(tag, [long_prompt], max_tokens, [0], prompt_logprobs=[5]),
        "batch_without": lambda tag: _requests(tag, batch, max_tokens, [None] * 8),
        "batch_with_one": lambda tag: _requests(tag, batch, max_tokens, [None] * 8, prompt_logprobs=[5] + [None] * 7),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    _run(scheduler, _requests("warm-plp", [long_prompt], 2, [0], prompt_logprobs=[5]))
    for r in range(rounds):
        for name, make in variants.items():
            scheduler.runner.cache_clear()
            wall, _ = _run(scheduler, make(f"{name}{r}"))
            times[name].append(wall)
    return {
        "prompt_words": 300,
        "max_tokens": max_tokens,
        "median_wall_s": {k: round(median(v), 3) for k, v in times.items()},
        "wall_s_by_round": {k: [round(x, 2) for x in v] for k, v in times.items()},
    }


def main() -> None:
    from ...shared.platform import reexec_as_worker

    reexec_as_worker("mlxgw.bench.step.choices")
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-speculation", action="store_true", help="greedy rows do not speculate")
    ap.add_argument("--only", choices=["logprobs", "n_choices", "prompt_logprobs"], help="one figure only")
    args = ap.parse_args()
    from ...worker.schedule.scheduler import Scheduler

    scheduler = Scheduler(_runner(args.model_dir, not args.no_speculation), max_num_seqs=8, max_queue=64)
    figures = {"logprobs": logprobs_cost, "n_choices": choices_cost, "prompt_logprobs": prompt_logprobs_cost}
    for name, measure in figures.items():
        if args.only in (None, name):
            print(json.dumps({name: measure(scheduler, args.max_tokens, args.rounds)}), flush=True)


if __name__ == "__main__":
    main()
