"""Retries after a cut: how much of a long prompt's prefill a retry gets back.

    python -m mlxgw.bench.agents.retry --url http://127.0.0.1:8000 --model smollm2-135m --rounds 2

Three cases per round, each with a fresh ~1,500-token prompt: a cold request (time to its
first token, max_tokens=1), the same-sized prompt cut at 60% of the cold prefill time and
then retried, and a stream cut right after its first token and then retried. Agent clients
on slow hosts give up and resend; the retry's cached_tokens and time say what that costs."""

from __future__ import annotations

import argparse
import random
import threading
import time

WORDS = "alpha beta gamma delta code file edit patch test build".split()


def main() -> None:
    import openai

    ap = argparse.ArgumentParser(prog="python -m mlxgw.bench.agents.retry")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--words", type=int, default=1500)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.url + "/v1", api_key="unused", max_retries=0, timeout=900)
    rng = random.Random()

    def prompt(tag: str) -> list[dict]:
        text = f"[{tag} {rng.random()}] " + " ".join(rng.choice(WORDS) for _ in range(args.words))
        return [{"role": "user", "content": text}]

    def first_token(messages):
        t0 = time.monotonic()
        r = client.chat.completions.create(model=args.model, messages=messages, max_tokens=1)
        return time.monotonic() - t0, r.usage

    def stream(messages, *, cut_after_s: float | None = None):
        s = client.chat.completions.create(model=args.model, messages=messages, max_tokens=64, stream=True)
        if cut_after_s is not None:
            threading.Timer(cut_after_s, s.close).start()
        try:
            for chunk in s:
                if cut_after_s is None and chunk.choices and chunk.choices[0].delta.content:
                    break
        except Exception:  # closed under the iterator by the timer
            pass
        s.close()

    for n in range(args.rounds):
        cold, usage = first_token(prompt(f"cold{n}"))
        print(f"cold: first token in {cold:.2f} s ({usage.prompt_tokens} prompt tokens)", flush=True)
        messages = prompt(f"mid{n}")
        stream(messages, cut_after_s=cold * 0.6)
        time.sleep(1.0)  # the cancel reaches the worker
        warm, usage = first_token(messages)
        cached = usage.prompt_tokens_details.cached_tokens
        print(f"  cut at 60% of the prefill, retry: {warm:.2f} s, {cached} of {usage.prompt_tokens} cached, "
              f"{cold / warm:.1f}x", flush=True)  # fmt: skip
        messages = prompt(f"first{n}")
        t0 = time.monotonic()
        stream(messages)
        cut = time.monotonic() - t0
        time.sleep(1.0)
        warm, usage = first_token(messages)
        cached = usage.prompt_tokens_details.cached_tokens
        print(f"  cut after its first token ({cut:.2f} s), retry: {warm:.2f} s, {cached} of "
              f"{usage.prompt_tokens} cached, {cut / warm:.1f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
