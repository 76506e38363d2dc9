"""Admission policies compared in-process: the real Scheduler + MLXRunner, same prompts, no HTTP.

    python -m mlxgw.bench.team.admission ~/.cache/mlxgw/models/smollm2-135m --concurrency 16,32 --rounds 3

Variants, alternated within each round, the order rotated each round (bench/method.py: 3
rounds by default, load per round, `--busy N`, exit 3 when a TTFT's rounds disagree by more
than --max-spread); the summary shows each TTFT p50 as the median with every round:
- mlx_lm.server's: every request goes to the BatchGenerator at once, which reads up to 8
  prompts per step in chunks of 2,048 tokens (`--prompt-concurrency 8`, `--prefill-step-size
  2048`, its defaults), in mlx-lm's step order (a prompt's first token two steps after its
  last chunk: worker/model/runners/batch_generator.py);
- budget: mlxgw's per-step prompt budget (512 tokens, worker/schedule/prefill_plan.py) always;
- budget+idle: the same, and four budgets per step while no row is decoding, new prompts
  admitted by those four budgets too (the default until 2026-12-02);
- budget+idle (BLAS fixed): that with the BLAS thread policy off (worker/model/cpu/blas_threads.py);
- before: budget+idle in mlx-lm's step order (mlxgw's engine until 2026-12-02);
- default: four budgets read per idle step, new prompts admitted by one budget, first tokens
  in the step that reads the prompt's last chunk (mlxgw's engine now);
- mlx-lm's BatchGenerator: no mlxgw runner at all, mlx-lm's own generator on the same model
  object, driven as mlx_lm.server drives it (8 prompts a step, 2,048-token chunks, one sampler
  per request). Against "mlx_lm.server's" this separates the runner's cost from the policy's.
Two loads: a burst (c requests at once) and a closed loop (c clients, 2c requests). TTFT is
from submission to the first token on the engine thread: the gateway and HTTP are not in it,
so this isolates the policy (bench/run.py measures through `mlxgw up`)."""

from __future__ import annotations

import argparse
import json
import time

from .. import method as bench_method
from ..loadgen import varied_prompts
from ..report import markdown_table
from ..stats import percentile, summarize

VARIANTS = {
    "mlx_lm.server's": {"budget": None, "prefill_batch": 8, "step": 2048, "idle": 1, "mlx_lm_order": True},
    "budget": {"budget": 512, "prefill_batch": None, "step": 512, "idle": 1},
    "budget+idle": {"budget": 512, "prefill_batch": None, "step": 512, "idle": 4, "idle_admit": 4},
    "budget+idle (BLAS fixed)": {
        "budget": 512,
        "prefill_batch": None,
        "step": 512,
        "idle": 4,
        "idle_admit": 4,
        "blas": False,
    },
    "before": {"budget": 512, "prefill_batch": None, "step": 512, "idle": 4, "idle_admit": 4, "mlx_lm_order": True},
    "default": {"budget": 512, "prefill_batch": None, "step": 512, "idle": 4},
    # tuning candidates for the default: an idle step admits two budgets; a step beside
    # decoding rows bounded at 2 s (the default before 2026-12-03) instead of 4
    "default; idle admits 2": {"budget": 512, "prefill_batch": None, "step": 512, "idle": 4, "idle_admit": 2},
    "default; 2 s decoding": {"budget": 512, "prefill_batch": None, "step": 512, "idle": 4, "pace_decoding_s": 2},
    "mlx-lm's BatchGenerator": {"bare": True, "prefill_batch": 8, "step": 2048},
}
DEFAULT_VARIANTS = ["mlx_lm.server's", "before", "default"]


def run_bare(runner, variant: dict, prompts: list, clients: int, max_tokens: int) -> dict:
    """mlx-lm's BatchGenerator on the runner's model, as mlx_lm.server drives it: TTFT from
    insertion to a row's first generated token."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    tok = runner.tokenizer
    gen = BatchGenerator(
        runner.model,
        stop_tokens=[[t] for t in sorted(tok.eos_token_ids)],
        completion_batch_size=runner.generator.completion_batch_size,
        prefill_batch_size=variant["prefill_batch"],
        prefill_step_size=variant["step"],
    )
    queue = [tok.apply_chat_template(m, add_generation_prompt=True) for m in prompts]
    sent, first, last, gaps, tokens, done = {}, {}, {}, [], 0, 0
    started = time.perf_counter()

    def submit() -> None:
        (uid,) = gen.insert([queue.pop(0)], max_tokens=[max_tokens], samplers=[make_sampler(temp=0.7)])
        sent[uid] = time.perf_counter()

    for _ in range(min(clients, len(queue))):
        submit()
    while done < len(prompts):
        _, generated = gen.next()
        now = time.perf_counter()
        for r in generated:
            tokens += 1
            if r.uid not in first:
                first[r.uid] = now - sent[r.uid]
            else:
                gaps.append(now - last[r.uid])
            last[r.uid] = now
            if r.finish_reason is not None:
                done += 1
                if queue:
                    submit()
    gen.close()
    wall = time.perf_counter() - started
    return _row(len(prompts), 0, tokens, wall, list(first.values()), gaps)


def _row(requests: int, failed: int, tokens: int, wall: float, ttfts: list, gaps: list) -> dict:
    return {
        "requests": requests,
        "failed": failed,
        "tok_s": round(tokens / wall, 2),
        "ttft_p50_s": round(percentile(ttfts, 50), 3),
        "ttft_p90_s": round(percentile(ttfts, 90), 3),
        "itl_p50_s": round(percentile(gaps, 50), 3) if gaps else None,
        "itl_max_s": round(max(gaps), 3) if gaps else None,
        "wall_s": round(wall, 2),
    }


def run_variant(runner, variant: dict, prompts: list, clients: int, max_tokens: int) -> dict:
    policy = runner.blas
    if policy is not None and (variant.get("bare") or not variant.get("blas", True)):
        policy.control.set(policy.most)  # a fixed count: OpenBLAS's own (all cores)
        runner.blas = None
    try:
        if variant.get("bare"):
            return run_bare(runner, variant, prompts, clients, max_tokens)
        return _run_scheduled(runner, variant, prompts, clients, max_tokens)
    finally:
        runner.blas = policy


def _run_scheduled(runner, variant: dict, prompts: list, clients: int, max_tokens: int) -> dict:
    from ...shared.protocol import GenerateRequest, SamplingParams
    from ...worker.schedule.scheduler import Scheduler

    runner.cache_clear()  # distinct prompts; no variant is served from another's cache
    gen = runner.generator
    gen.prefill_batch_size = variant["prefill_batch"] or gen.completion_batch_size
    gen.prefill_step_size = variant["step"]
    gen.reads_first = not variant.get("mlx_lm_order", False)
    sched = Scheduler(
        runner,
        max_num_seqs=gen.completion_batch_size,
        max_queue=len(prompts),
        prefill_budget=variant["budget"],
        idle_budget_factor=variant["idle"],
    )
    sched.prefill.idle_admit_factor = variant.get("idle_admit", 1)
    if "pace_decoding_s" in variant:
        sched.prefill.pace.max_step_decoding_s = variant["pace_decoding_s"]
    queue, sent, first, ends = list(enumerate(prompts)), {}, {}, {}
    gaps: list[float] = []
    last: dict[str, float] = {}
    started = time.perf_counter()

    def submit() -> None:
        i, messages = queue.pop(0)
        rid = f"r{i}"
        sent[rid] = time.perf_counter()
        sampling = SamplingParams(temperature=0.7, seed=i)
        sched.submit(GenerateRequest(rid=rid, messages=messages, max_tokens=max_tokens, sampling=sampling))

    for _ in range(min(clients, len(queue))):
        submit()
    tokens = 0
    while sched.has_work():
        for rid, ev in sched.step():
            now = time.perf_counter()
            if ev.KIND in ("delta", "finish"):
                if rid not in first:
                    first[rid] = now - sent[rid]
                elif rid in last:
                    gaps.append(now - last[rid])
                last[rid] = now
            if ev.KIND in ("finish", "error"):
                ends[rid] = ev
                tokens += ev.usage.completion_tokens if ev.usage else 0
                if queue:
                    submit()
    wall = time.perf_counter() - started
    failed = sum(1 for e in ends.values() if e.KIND != "finish")
    return _row(len(prompts), failed, tokens, wall, list(first.values()), gaps)


def main() -> None:
    from ...shared.platform import reexec_as_worker

    reexec_as_worker("mlxgw.bench.team.admission")
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--concurrency", default="16,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--loads", default="burst,closed")
    ap.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, of: {'; '.join(VARIANTS)}"
    )
    ap.add_argument("--out", default=None)
    bench_method.add_arguments(ap)
    args = ap.parse_args()
    method = bench_method.from_args(args)
    from ...worker.process.build_mlx import build_mlx_runner

    levels = [int(c) for c in args.concurrency.split(",")]
    runner = build_mlx_runner(
        args.model_dir, context_length=None, max_num_seqs=max(levels), prefill_step_size=2048, cache_bytes=0
    )
    run_variant(runner, VARIANTS["budget"], varied_prompts(4, args.prompt_words, seed=7), 4, 4)  # warm-up
    rows = []
    with method.busy_loops():
        for rnd, names in method.each_round([v.strip() for v in args.variants.split(",")]):
            for c in levels:
                for load in args.loads.split(","):
                    rows += _level(runner, rnd, c, load, names, args)
    print(summary(rows, method))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "method": method.as_dict()}, f, indent=1)
    raise SystemExit(method.finish())


def _level(runner, rnd: int, c: int, load: str, names: list[str], args) -> list[dict]:
    n = c if load == "burst" else 2 * c
    prompts = varied_prompts(n, args.prompt_words, seed=1000 * rnd + c)
    rows = []
    for name in names:
        row = {
            "round": rnd,
            "c": c,
            "load": load,
            "variant": name,
            **run_variant(runner, VARIANTS[name], prompts, c, args.max_tokens),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def summary(rows: list[dict], method) -> str:
    """TTFT p50 and p90 per level and variant: median over the rounds, every round shown."""
    header = "c | load | variant | TTFT p50 s (rounds) | spread | TTFT p90 s (median)"
    out = []
    for c, load, name in dict.fromkeys((r["c"], r["load"], r["variant"]) for r in rows):
        same = [r for r in rows if (r["c"], r["load"], r["variant"]) == (c, load, name)]
        p50 = summarize([r["ttft_p50_s"] for r in same])
        method.check(f"c={c} {load} {name} TTFT p50", p50)
        p90 = summarize([r["ttft_p90_s"] for r in same]).median
        out.append([c, load, name, p50.cell(3), method.flag_cell(p50), f"{p90:.3f}"])
    return markdown_table(header, out)


if __name__ == "__main__":
    main()
