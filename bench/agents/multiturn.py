"""The multi-turn agent workload over HTTP, on servers this bench starts on one model folder:
a long system prompt with tool definitions, four turns, greedy, streamed; the time to first
token of every turn.

    python -m mlxgw.bench.agents.multiturn ~/.cache/mlxgw/models/gemma3-270m --system-tokens 4000 \\
        [--vllm-python VLLM_VENV/bin/python] [--api completions|chat] --rounds 3 [--busy 2]

It starts `mlxgw up` (this checkout), `mlx_lm.server` and, with --vllm-python, vllm-mlx
(bench/serving/peers.py, the same OpenBLAS for all), and runs under bench/method.py: every server once
per round, the order rotated each round, the load average of every round recorded, every round
beside its median, exit status 3 when the warm/cold ratio's rounds disagree by more than
--max-spread.

Each conversation starts with a fresh nonce at the head of its system prompt (nothing cached:
turn 1 is cold); turns 2-4 extend it (what a prefix cache can serve: warm). On a sliding-window
or hybrid model the cold/warm ratio shows whether a server keeps its prefix (mlxgw's state
checkpoints, docs/models.md) or prefills the whole prompt again. `--api completions` (the
default) sends the conversation as a growing transcript to /v1/completions, so a base model
without a chat template (Gemma 3 270M) runs too and every server sees the same text; the tools
are JSON in the system text, as a chat template would render them."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from .. import method as bench_method
from ..method import Method
from ..report import markdown_table
from ..servers import (
    ServerProcess,
    registry,
    show_log_tails,
    spawn_mlx_lm,
    spawn_mlxgw,
    spawn_vllm_mlx,
    stop_all,
)
from ..stats import paired_ratios, summarize

QUESTIONS = ["What does the scheduler do?", "And the prefix cache?", "Who reviews changes?", "Summarise it."]
RULE = "the team writes small functions, tests real components and names things clearly"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
    for name, description in [
        ("read_file", "Read a file of the repository and return its text."),
        ("write_file", "Write a file of the repository."),
        ("run_tests", "Run the tests under a path and return their output."),
        ("search", "Search the repository for a string and return the matching lines."),
    ]
]


def system_prompt(tokenizer, tokens: int) -> str:
    """A fresh system prompt of about `tokens` tokens: a nonce (so no server has it cached),
    the tool definitions, then numbered rules up to the size."""
    head = f"Session {uuid.uuid4().hex}. You can call these tools:\n{json.dumps(TOOLS)}\n"
    per_rule = len(tokenizer.encode(f" Rule 10: {RULE}.", add_special_tokens=False))
    missing = max(0, tokens - len(tokenizer.encode(head, add_special_tokens=False)))
    return head + " ".join(f"Rule {i}: {RULE}." for i in range(missing // per_rule + 1))


def stream_first_token(url: str, path: str, body: dict) -> tuple[float | None, str]:
    """One greedy streaming request: (seconds to the first content, the whole text)."""
    req = urllib.request.Request(f"{url}/{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    started, first, pieces = time.perf_counter(), None, []
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if not choices:
                continue
            text = choices[0].get("text") if path == "completions" else (choices[0].get("delta") or {}).get("content")
            if text:
                first = first or time.perf_counter() - started
                pieces.append(text)
    return first, "".join(pieces)


def conversation(url: str, model: str, system: str, api: str, max_tokens: int) -> dict:
    """One four-turn conversation: each turn's TTFT (s) and text."""
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    messages = [{"role": "system", "content": system}]
    transcript = system
    ttfts, texts = [], []
    for question in QUESTIONS:
        if api == "chat":
            messages.append({"role": "user", "content": question})
            first, text = stream_first_token(url, "chat/completions", {**common, "messages": messages})
            messages.append({"role": "assistant", "content": text})
        else:
            transcript += f"\n\nUser: {question}\nAssistant:"
            first, text = stream_first_token(url, "completions", {**common, "prompt": transcript})
            transcript += text
        ttfts.append(round(first, 3) if first is not None else None)
        texts.append(text)
    return {"ttft_s": ttfts, "texts": texts}


def warm_up(url: str, model: str, api: str) -> None:
    """One short request in the API the run uses (a base model has no chat template), so that
    no server's first conversation pays its lazy setup."""
    body = {"model": model, "max_tokens": 4, "temperature": 0.0, "stream": True}
    if api == "chat":
        stream_first_token(url, "chat/completions", {**body, "messages": [{"role": "user", "content": "hi"}]})
    else:
        stream_first_token(url, "completions", {**body, "prompt": "User: hi\nAssistant:"})


def warm_of(run: dict) -> float | None:
    """A conversation's warm TTFT: the median of turns 2-4."""
    return summarize(run["ttft_s"][1:]).median


def markdown(runs: dict[str, list[dict]], method: Method, goal: float) -> str:
    """Per server: turn 1 (cold), turns 2, 3, 4 and their median (warm), cold/warm paired per
    conversation, whether the goal ratio is met; every round beside each median."""
    header = (
        "server | turn 1 TTFT s (cold) | turn 2 s | turn 3 s | turn 4 s | turns 2-4 median s (warm) | "
        f"cold / warm, per round | spread | >= {goal:g}x"
    )
    rows = []
    for label, rs in runs.items():
        turns = [summarize([r["ttft_s"][t] for r in rs]) for t in range(len(QUESTIONS))]
        warm = summarize([warm_of(r) for r in rs])
        ratio = summarize(paired_ratios([r["ttft_s"][0] for r in rs], [warm_of(r) for r in rs]))
        method.check(f"{label} cold/warm", ratio)
        met = "yes" if ratio.low is not None and ratio.low >= goal else "no"
        rows.append([label, *(t.cell(3) for t in turns), warm.cell(3), ratio.cell(1), method.flag_cell(ratio), met])
    return markdown_table(header, rows)


def measure(servers: list[tuple], tokenizer, args, method: Method) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {label: [] for label, *_ in servers}
    with method.busy_loops():
        for rnd, order in method.each_round(servers, label=lambda s: s[0]):
            for label, url, _, model in order:
                run = conversation(url, model, system_prompt(tokenizer, args.system_tokens), args.api, args.max_tokens)
                runs[label].append(run)
                print(f"round {rnd + 1} {label}: TTFT per turn {run['ttft_s']} s", flush=True)
    return runs


def start_servers(model_dir: Path, home: Path, args, started: list[ServerProcess]) -> None:
    """mlxgw and the peers asked for, appended to `started` as each starts (so that a failed
    start still stops the ones before it)."""
    started.append(spawn_mlxgw(home, registry(model_dir)))
    if not args.no_mlx_lm:
        started.append(spawn_mlx_lm(model_dir, home))
    if args.vllm_python:
        started.append(spawn_vllm_mlx(args.vllm_python, model_dir, home))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-mlx installed")
    ap.add_argument("--no-mlx-lm", action="store_true", help="skip mlx_lm.server")
    ap.add_argument("--api", choices=("completions", "chat"), default="completions")
    ap.add_argument("--system-tokens", type=int, default=4000, help="system prompt size, tools included")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--goal", type=float, default=10.0, help="the cold/warm ratio the table checks")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    bench_method.add_arguments(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    method = bench_method.from_args(args)
    # A timeout's SIGTERM must still stop the servers this bench started (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model_dir = args.model_dir.expanduser().resolve()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    started: list[ServerProcess] = []
    with tempfile.TemporaryDirectory(prefix="mlxgw-multiturn-") as tmp:
        try:
            start_servers(model_dir, Path(tmp), args, started)
            for server in started:
                server.wait_ready()
                warm_up(server.api, server.model, args.api)
                print(f"{server.label} ready at {server.api}", flush=True)
            servers = [(s.label, s.api, s, s.model) for s in started]
            runs = measure(servers, tokenizer, args, method)
        except Exception:
            show_log_tails(started)
            raise
        finally:
            stop_all(started)
    md = markdown(runs, method, args.goal)
    head = f"({method.header()}; {args.api}, ~{args.system_tokens}-token system prompt with 4 tools, greedy, "
    md = head + f"{args.max_tokens} tokens a turn)\n\n{md}\n\n" + "\n".join(x.line() for x in method.logs)
    print(md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"config": {k: str(v) for k, v in vars(args).items()}, "method": method.as_dict(), "runs": runs}
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
        args.out.with_suffix(".md").write_text(md + "\n")
    sys.exit(method.finish())


if __name__ == "__main__":
    main()
