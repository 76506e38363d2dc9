"""mlxgw against its peers on equal terms: one model folder, one BLAS, one client, one run.

Starts mlxgw (`mlxgw up`), `mlx_lm.server` and, when a Python with vllm-mlx is given,
`vllm-mlx serve --continuous-batching`, all on the same model folder and with the same
OpenBLAS preloaded (shared/platform.worker_environment, as mlxgw's own workers get it), then
runs `mlxgw bench`'s sweep against all of them under bench/method.py: 3 rounds by default,
servers alternated within every level and their order rotated each round, the load average
of every round recorded, every round shown beside its median, `--busy N` fixed busy loops
beside all servers, exit status 3 when rounds disagree by more than `--max-spread`. Only
loopback ports; every server and busy loop is stopped at the end.

    python -m mlxgw.bench.serving.peers ~/.cache/mlxgw/models/smollm2-135m \\
        --vllm-python VLLM_VENV/bin/python --concurrency 1,8,16,32 --rounds 3 [--busy 2]

`--agent` also runs bench/speculation/inprocess.py's agent workload through each server's HTTP API
(a ~2k-token code file and an instruction to return it with a small edit, greedy, 512
tokens), one request per server per round, and reports decode speed (median and every
round, mean +- stdev, the ratio to mlxgw paired within rounds) and whether each output
equals mlxgw's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from .. import method as bench_method
from ..method import Method
from ..report import markdown_table
from ..run import BenchConfig, Target, run
from ..servers import (
    ServerProcess,
    registry,
    show_log_tails,
    spawn_mlx_lm,
    spawn_mlxgw,
    spawn_vllm_mlx,
    stop_all,
    warm_up,
)
from ..speculation.inprocess import agent_messages
from ..stats import paired_ratios, summarize


def agent_request(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One greedy streaming request: TTFT, decode tokens/s after the first token, the text."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    req = urllib.request.Request(
        f"{url}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    first = last = None
    pieces: list[str] = []
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            text = (choices[0].get("delta") or {}).get("content") if choices else None
            if text:
                last = time.perf_counter()
                first = first or last
                pieces.append(text)
    chunks = len(pieces)
    decode = (chunks - 1) / (last - first) if chunks > 1 and last > first else None
    return {
        "ttft_s": round(first - started, 3) if first else None,
        "chunks": chunks,
        "decode_chunks_s": round(decode, 2) if decode else None,
        "e2e_s": round((last or time.perf_counter()) - started, 2),
        "text": "".join(pieces),
    }


def agent_table(
    servers: list[ServerProcess], model_dir: Path, method: Method, max_tokens: int, out: Path | None = None
) -> str:
    """The agent workload on every server, one request each per round, the order rotated
    round by round; every round shown beside the median, ratios paired within rounds."""
    from transformers import AutoTokenizer

    messages = agent_messages(AutoTokenizer.from_pretrained(str(model_dir)), 2000)
    runs: dict[str, list[dict]] = {server.label: [] for server in servers}
    for rnd, order in method.each_round(servers, label=lambda s: s.label):
        for server in order:
            label = server.label
            runs[label].append(agent_request(server.api, server.model, messages, max_tokens))
            r = runs[label][-1]
            print(f"agent round {rnd + 1} {label}: TTFT {r['ttft_s']} s, {r['decode_chunks_s']} chunks/s", flush=True)
    table = agent_markdown(runs, method)
    if out is not None:  # every round (texts left out) and the rounds' load, beside the sweep's report
        rounds = {label: [{k: v for k, v in r.items() if k != "text"} for r in rs] for label, rs in runs.items()}
        report = {"runs": rounds, "method": method.as_dict(), "markdown": table}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".agent.json").write_text(json.dumps(report, indent=2))
    return table


def agent_markdown(runs: dict[str, list[dict]], method: Method) -> str:
    """The agent table from each server's rounds (in the order they ran): decode chunks/s
    median (rounds), mean +- stdev, spread, the paired ratio to the first server, TTFT, e2e
    and whether every output equals the first server's first one."""
    first = next(iter(runs))
    reference = runs[first][0]["text"]
    header = (
        f"server | decode chunks/s median (rounds) | mean +- stdev | spread | {first} / server (per-round ratios) | "
        f"TTFT s median (rounds) | e2e s median | output = {first}'s"
    )
    rows = []
    for label, rs in runs.items():
        decode = summarize([r["decode_chunks_s"] for r in rs])
        method.check(f"agent {label} decode chunks/s", decode)
        ttft = summarize([r["ttft_s"] for r in rs])
        e2e = summarize([r["e2e_s"] for r in rs])
        ratio = "" if label == first else _ratio_cell(runs[first], rs, method, label)
        spread_sd = f"{decode.mean:.2f} +- {decode.stdev:.2f}" if decode.stdev is not None else ""
        same = all(r["text"] == reference for r in rs)
        rows.append(
            [
                label,
                decode.cell(),
                spread_sd,
                method.flag_cell(decode),
                ratio,
                ttft.cell(3),
                e2e.cell(),
                "yes" if same else "no",
            ]
        )
    return markdown_table(header, rows)


def _ratio_cell(ours: list[dict], theirs: list[dict], method: Method, label: str) -> str:
    n = min(len(ours), len(theirs))
    pairs = summarize(
        paired_ratios([r["decode_chunks_s"] for r in ours[:n]], [r["decode_chunks_s"] for r in theirs[:n]])
    )
    method.check(f"agent ratio to {label}", pairs)
    return pairs.cell(2) if pairs.median is not None else ""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-mlx installed")
    ap.add_argument("--no-mlx-lm", action="store_true", help="skip mlx_lm.server")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="mlxgw's batch (default: its own default)")
    ap.add_argument("--concurrency", default="1,4,8,16,32")
    ap.add_argument("--requests", type=int, default=0, help="per level (default 2 x c, >= 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--agent", action="store_true", help="also run the agent workload (--rounds rounds)")
    ap.add_argument("--agent-max-tokens", type=int, default=512)
    ap.add_argument("--no-sweep", action="store_true", help="only the agent workload")
    bench_method.add_arguments(ap)
    args = ap.parse_args(argv)
    method = bench_method.from_args(args)
    model_dir = args.model_dir.expanduser().resolve()
    servers: list[ServerProcess] = []
    status = 0
    with tempfile.TemporaryDirectory(prefix="mlxgw-peers-") as tmp:
        home = Path(tmp)
        try:
            entry = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
            servers.append(spawn_mlxgw(home, registry(model_dir, **entry)))
            if not args.no_mlx_lm:
                servers.append(spawn_mlx_lm(model_dir, home))
            if args.vllm_python:
                servers.append(spawn_vllm_mlx(args.vllm_python, model_dir, home))
            for server in servers:
                server.wait_ready()
                warm_up(server.api, server.model)
                print(f"{server.label} ready at {server.api}", flush=True)
            status = measure(servers, model_dir, args, method)
        except Exception:
            show_log_tails(servers)
            raise
        finally:
            stop_all(servers)
    sys.exit(status)


def measure(servers: list[ServerProcess], model_dir: Path, args: argparse.Namespace, method: Method) -> int:
    """The sweep and the agent workload on ready servers, with the busy loops running
    throughout; the exit status (UNSTABLE_EXIT when rounds disagree)."""
    targets = [Target(s.label, s.api, s.model) for s in servers]
    cfg = BenchConfig(
        concurrency=[int(c) for c in args.concurrency.split(",")],
        requests=args.requests,
        max_tokens=args.max_tokens,
        prompt_words=40,
        prompt_words_max=None,
        temperature=args.temperature,
        stream=True,
        fixed_prompt=False,
        prefix_words=0,
        prefix_repeats=0,
        seed=args.seed if args.seed is not None else int(time.time()) % (1 << 30),
        rounds=args.rounds,
    )
    status = 0
    with method.busy_loops():
        if not args.no_sweep:
            report = run(targets, cfg, args.out, method=method)
            print(report["markdown"])
            status = report["exit_status"]
        if args.agent:
            agent_method = dataclasses.replace(method, logs=[], unstable=[])
            print(agent_table(servers, model_dir, agent_method, args.agent_max_tokens, args.out))
            status = agent_method.finish() or status
    return status


if __name__ == "__main__":
    main()
