"""Baseline: mlx-lm's BatchGenerator driven in-process (no HTTP, no IPC), same prompts.

    python -m mlxgw.bench.step.inprocess MODEL_DIR --concurrency 1,8 --max-tokens 32

Runs under the same environment the gateway gives its workers (OpenBLAS on Linux)."""

from __future__ import annotations

import argparse
import json
import time


def measure(
    model_dir: str, concurrency: int, max_tokens: int, prompt_words: int, temperature: float, seed: int
) -> dict:
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    from ..loadgen import varied_prompts
    from ..stats import percentile

    model, tok = load(model_dir)
    prompts = [
        tok.apply_chat_template(m, add_generation_prompt=True) for m in varied_prompts(concurrency, prompt_words, seed)
    ]
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tok.eos_token_ids],
        completion_batch_size=concurrency,
        prefill_batch_size=concurrency,
        prefill_step_size=512,
    )
    sampler = make_sampler(temp=temperature)
    # Warm up once so compilation and allocation are not measured.
    gen.insert([prompts[0]], max_tokens=[2], samplers=[sampler])
    while gen.next_generated() or gen._unprocessed_sequences or len(gen._prompt_batch):
        pass
    started = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts), samplers=[sampler] * len(prompts))
    first: dict[int, float] = {}
    tokens = 0
    pending = set(uids)
    while pending:
        for r in gen.next_generated():
            first.setdefault(r.uid, time.perf_counter() - started)
            if r.finish_reason != "stop":
                tokens += 1
            if r.finish_reason is not None:
                pending.discard(r.uid)
    wall = time.perf_counter() - started
    return {
        "server": "in-process",
        "concurrency": concurrency,
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 2),
        "ttft_p50_s": round(percentile(list(first.values()), 50), 4),
    }


def main() -> None:
    from ...shared.platform import reexec_as_worker

    reexec_as_worker("mlxgw.bench.step.inprocess")
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for c in (int(x) for x in args.concurrency.split(",")):
        print(
            json.dumps(measure(args.model_dir, c, args.max_tokens, args.prompt_words, args.temperature, args.seed)),
            flush=True,
        )


if __name__ == "__main__":
    main()
