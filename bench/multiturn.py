"""The multi-turn agent workload over HTTP: a long system prompt, four turns, greedy, streamed;
the time to first token of every turn, on any OpenAI-compatible servers (mlxgw,
mlx_lm.server, vllm-mlx), alternated round by round so a busy machine slows them alike.

Turn 1 of each round starts a new conversation whose system prompt opens with a fresh nonce
(nothing cached: cold); turns 2-4 extend it (what a prefix cache can serve: warm). On a
sliding-window or hybrid model the warm/cold ratio shows whether the server keeps its prefix
(mlxgw's state checkpoints, docs/models.md) or prefills the whole prompt again.

    python -m mlxgw.bench.multiturn --url http://127.0.0.1:8000/v1 --model gemma3-270m \\
        --compare http://127.0.0.1:8080/v1 --compare-model default --system-words 3000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

QUESTIONS = ["What does the scheduler do?", "And the prefix cache?", "Who reviews changes?", "Summarise it."]


def system_prompt(words: int) -> str:
    rule = "the team writes small functions, tests real components and names things clearly"
    return f"Session {uuid.uuid4().hex}. " + " ".join(f"Rule {i}: {rule}." for i in range(words // 14 + 1))


def conversation(client, model: str, words: int, max_tokens: int) -> list[float]:
    """One four-turn conversation; each turn's time to first token in seconds."""
    messages = [{"role": "system", "content": system_prompt(words)}]
    ttfts = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        started, first, text = time.perf_counter(), None, []
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
        )
        for chunk in stream:
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta:
                first = first or time.perf_counter() - started
                text.append(delta)
        ttfts.append(first if first is not None else float("nan"))
        messages.append({"role": "assistant", "content": "".join(text)})
    return ttfts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--label", default="mlxgw")
    ap.add_argument("--compare", action="append", default=[], help="another server's base URL")
    ap.add_argument("--compare-model", action="append", default=[])
    ap.add_argument("--compare-label", action="append", default=[])
    ap.add_argument("--system-words", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import openai

    servers = [(args.label, args.url, args.model)]
    for i, url in enumerate(args.compare):
        model = args.compare_model[i] if i < len(args.compare_model) else args.model
        label = args.compare_label[i] if i < len(args.compare_label) else f"peer{i + 1}"
        servers.append((label, url, model))
    results: dict[str, list[list[float]]] = {label: [] for label, _, _ in servers}
    for r in range(args.rounds):
        order = servers[r % len(servers) :] + servers[: r % len(servers)]
        for label, url, model in order:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
            results[label].append(conversation(client, model, args.system_words, args.max_tokens))
    print("| server | turn 1 TTFT s (cold) | turns 2-4 TTFT s (warm) | cold / warm |")
    print("|---|---|---|---|")
    for label, runs in results.items():
        cold = statistics.median(run[0] for run in runs)
        warm = statistics.median(t for run in runs for t in run[1:])
        print(f"| {label} | {cold:.2f} | {warm:.2f} | {cold / warm:.1f}x |")
    print(json.dumps({"system_words": args.system_words, "rounds": args.rounds, "ttft_s": results}))


if __name__ == "__main__":
    main()
