"""The agent workload, with and without speculative decoding (prompt lookup, and a draft
model when --draft-model is given), measured on
the worker's own scheduler and MLX runner in-process (no HTTP, no IPC): a ~2k-token code
file in the prompt and an instruction to return it with a small edit, greedy, 512 tokens.

Both variants are loaded once and take turns in every round under bench/method.py (3 rounds
by default, the order rotated each round, the load average recorded per round, `--busy N`,
exit status 3 when a speedup's rounds differ by more than --max-spread), so a busy machine
slows both alike; the outputs must be identical (greedy speculation changes speed only).
Each speedup is the median of per-round ratios (both variants ran back to back), with every
round beside it.

    python -m mlxgw.bench.speculation.inprocess MODEL_DIR --max-tokens 512 --rounds 3 [--max-draft 8]
        [--draft-model DRAFT_DIR] [--busy 2]
(see bench/speculation/matrix.py for the same question through the server at c = 1..32)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .. import method as bench_method
from ..method import Method
from ..stats import paired_ratios, summarize

CODE_FILE = Path(__file__).resolve().parent.parent / "worker" / "scheduler.py"
INSTRUCTION = (
    "Here is a Python file. Return the complete file with one change: rename the function "
    "`_parts` to `_delta_parts` everywhere. Output only the code.\n\n```python\n{code}```"
)


def agent_messages(tokenizer, code_tokens: int) -> list[dict]:
    """The chat messages: the first lines of a real code file (about code_tokens tokens)
    and the instruction to return it with a small edit."""
    lines, used = [], 0
    for line in CODE_FILE.read_text().splitlines(keepends=True):
        used += len(tokenizer.encode(line, add_special_tokens=False))
        if used > code_tokens:
            break
        lines.append(line)
    return [{"role": "user", "content": INSTRUCTION.format(code="".join(lines))}]


def agent_prompt(tokenizer, code_tokens: int) -> list[int]:
    """The chat prompt's token ids."""
    return tokenizer.apply_chat_template(agent_messages(tokenizer, code_tokens), add_generation_prompt=True)


def _scheduler(model_dir: str, speculative):
    from ...worker.process.build_mlx import build_mlx_runner
    from ...worker.schedule.scheduler import Scheduler

    # No prefix cache: every round prefills the same way, only decoding differs.
    runner = build_mlx_runner(
        model_dir,
        context_length=None,
        max_num_seqs=8,
        prefill_step_size=512,
        cache_bytes=0,
        speculative=speculative,
    )
    return Scheduler(runner, max_num_seqs=8, max_queue=8)


def run_once(scheduler, prompt: list[int], max_tokens: int, rid: str) -> dict:
    """One greedy request to its end: TTFT, decode tokens/s (after the first token), text."""
    from ...shared import protocol as p
    from ...shared.events import EventKind

    started = time.perf_counter()
    req = p.GenerateRequest(
        rid=rid, prompt_tokens=prompt, sampling=p.SamplingParams(temperature=0.0), max_tokens=max_tokens
    )
    events, text, first = scheduler.submit(req), "", None
    while True:
        for _, ev in events:
            if ev.KIND in (EventKind.DELTA, EventKind.FINISH):
                first = first or time.perf_counter()
                text += ev.text or ""
            if ev.KIND == EventKind.ERROR:
                raise RuntimeError(ev)
            if ev.KIND == EventKind.FINISH:
                done = time.perf_counter()
                tokens = ev.usage.completion_tokens
                return {
                    "tokens": tokens,
                    "ttft_s": first - started,
                    "decode_tok_s": (tokens - 1) / (done - first) if done > first else 0.0,
                    "total_tok_s": tokens / (done - started),
                    "text": text,
                }
        events = scheduler.step()


def measure(
    model_dir: str,
    max_tokens: int,
    method: Method,
    code_tokens: int,
    max_draft: int = 8,
    draft_model: str | None = None,
) -> dict:
    from mlx_lm.utils import load_tokenizer

    from ...shared.model_sections import SpeculativeConfig

    prompt = agent_prompt(load_tokenizer(Path(model_dir)), code_tokens)
    configs = {mode: SpeculativeConfig(mode=mode, max_draft=max_draft) for mode in ("off", "prompt_lookup")}
    if draft_model:
        path = str(Path(draft_model).resolve())
        configs["draft"] = SpeculativeConfig(mode="draft", draft_model=path, max_draft=max_draft)
    variants = {mode: _scheduler(model_dir, config) for mode, config in configs.items()}
    for mode, sched in variants.items():  # warm-up: allocation and first-call costs
        run_once(sched, prompt[:64], 4, f"warm-{mode}")
    results: dict[str, list[dict]] = {mode: [] for mode in variants}
    with method.busy_loops():
        for r, order in method.each_round(list(variants)):
            for mode in order:
                results[mode].append(run_once(variants[mode], prompt, max_tokens, f"{mode}-{r}"))
                print(json.dumps({"round": r, "mode": mode, **_public(results[mode][-1])}), flush=True)
    texts = {res["text"] for runs in results.values() for res in runs}
    rates = {m: [x["decode_tok_s"] for x in results[m]] for m in variants}
    rate = {m: summarize(v).median for m, v in rates.items()}
    speedup = {m: summarize(paired_ratios(rates[m], rates["off"])) for m in variants if m != "off"}
    for m, s in speedup.items():
        method.check(f"speedup {m}", s)
    stats = variants["prompt_lookup"].runner.stats()["speculative"]
    summary = {
        "prompt_tokens": len(prompt),
        "completion_tokens": results["off"][0]["tokens"],
        "outputs_identical": len(texts) == 1,
        "decode_tok_s_off": round(rate["off"], 2),
        "decode_tok_s_speculative": round(rate["prompt_lookup"], 2),
        "decode_tok_s_rounds": {m: [round(v, 2) for v in r] for m, r in rates.items()},
        "speedup": round(speedup["prompt_lookup"].median, 2),
        "speedup_rounds": [round(v, 2) for v in speedup["prompt_lookup"].rounds],
        "speedup_spread": speedup["prompt_lookup"].as_dict()["spread"],
        "round_logs": [log.line() for log in method.logs],
        "acceptance_rate": stats["acceptance_rate"],
        "tokens_per_speculative_step": stats["tokens_per_speculative_step"],
        "pauses": stats["pauses"],
    }
    if "draft" in variants:
        draft = variants["draft"].runner.stats()["speculative"]
        summary.update(
            decode_tok_s_draft=round(rate["draft"], 2),
            speedup_draft=round(speedup["draft"].median, 2),
            speedup_draft_rounds=[round(v, 2) for v in speedup["draft"].rounds],
            acceptance_rate_draft=draft["acceptance_rate"],
            tokens_per_speculative_step_draft=draft["tokens_per_speculative_step"],
            pauses_draft=draft["pauses"],
        )
    return summary


def _public(res: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items() if k != "text"}


def main() -> None:
    from ...shared.platform import reexec_as_worker

    reexec_as_worker("mlxgw.bench.speculation.inprocess")
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--code-tokens", type=int, default=2000)
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--draft-model", help="a draft model's folder: adds a draft-model variant")
    bench_method.add_arguments(ap)
    args = ap.parse_args()
    method = bench_method.from_args(args)
    result = measure(args.model_dir, args.max_tokens, method, args.code_tokens, args.max_draft, args.draft_model)
    print(json.dumps({"max_draft": args.max_draft, **result}), flush=True)
    raise SystemExit(method.finish())


if __name__ == "__main__":
    main()
