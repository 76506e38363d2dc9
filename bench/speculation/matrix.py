"""Speculation on against off, through the server, at every concurrency, with greedy parity.

    python -m mlxgw.bench.speculation.matrix ~/.cache/mlxgw/models/smollm2-135m \\
        --concurrency 1,8,16,32 --workloads distinct,fixed,agent --rounds 3 [--busy 2]

One `mlxgw up` serves the model folder twice: `spec-off` (speculative: {mode: off}) and
`spec-on` (prompt lookup, --max-draft), both loaded, with the same rows (--max-num-seqs,
default the largest c). Under bench/method.py (3 rounds by default, the two variants
alternated at every level with the order rotated each round, load recorded per round,
`--busy N`, exit 3 when rounds disagree by more than --max-spread) every workload runs at
every concurrency, greedy and streaming:
- distinct: distinct 40-word prompts (drafts come only from each row's own text);
- fixed: one prompt for every request (prefix cache and repetition: drafts find matches);
- agent: the code-edit task of bench/speculation/inprocess.py (a ~--code-tokens slice of a real code
  file, to be returned with one rename), a different slice per request so rows differ.
The prompts are the same in every round and the prefix caches are emptied before every
level, so each level starts cold and the greedy texts can be compared across rounds too.
Reported per workload and c: tokens/s off and on (median, every round), the on/off ratio
paired within rounds, TTFT and ITL p50, and whether every request's greedy text was the
same with speculation on as off (and in every round). The speculative counters of the
`spec-on` worker (acceptance, pauses) come from /v1/status when it reports them."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from .. import method as bench_method
from ..loadgen import run_level, varied_prompts
from ..method import Method
from ..report import markdown_table
from ..servers import ServerProcess, show_log_tails, spawn_mlxgw, stop_all, warm_up
from ..stats import paired_ratios, percentile, summarize

VARIANTS = ("spec-off", "spec-on")
CODE_DIR = Path(__file__).resolve().parent.parent / "worker"


def agent_prompts(tokenizer, n: int, code_tokens: int) -> list[list[dict]]:
    """n code-edit requests, each on its own ~code_tokens slice of the worker's code files."""
    from .inprocess import INSTRUCTION

    lines = [ln for f in sorted(CODE_DIR.glob("*.py")) for ln in f.read_text().splitlines(keepends=True)]
    out, start = [], 0
    for _ in range(n):
        chunk, used, i = [], 0, start
        while used < code_tokens and i < len(lines):
            used += len(tokenizer.encode(lines[i], add_special_tokens=False))
            chunk.append(lines[i])
            i += 1
        start = i if i < len(lines) else 0
        out.append([{"role": "user", "content": INSTRUCTION.format(code="".join(chunk))}])
    return out


def workload_prompts(name: str, n: int, seed: int, tokenizer, code_tokens: int) -> list[list[dict]]:
    if name == "distinct":
        return varied_prompts(n, 40, seed)
    if name == "fixed":
        return varied_prompts(1, 40, seed) * n
    if name == "agent":
        return agent_prompts(tokenizer, n, code_tokens)
    raise ValueError(f"unknown workload {name!r}: distinct, fixed or agent")


def start_gateway(model_dir: Path, home: Path, rows: int, args) -> ServerProcess:
    common = {"source": str(model_dir), "preload": True, "max_num_seqs": rows}
    spec = {"mode": "prompt_lookup", "max_draft": args.max_draft}
    if args.max_rows:
        spec["max_rows"] = args.max_rows
    config = {
        "manager": {"auto_discover": False, "max_loaded_models": 2},
        "models": [
            {"name": "spec-off", **common, "speculative": {"mode": "off"}},
            {"name": "spec-on", **common, "speculative": spec},
        ],
    }
    return spawn_mlxgw(home, config)


def clear_cache(url: str) -> None:
    """Empty the prefix caches, so that every level starts cold for both variants and a round
    does not answer from the previous round's prompts (the same prompts every round)."""
    req = urllib.request.Request(f"{url}/cache", method="DELETE")
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def level(url: str, variant: str, prompts: list[list[dict]], c: int, max_tokens: int) -> dict:
    clear_cache(url)
    # A long timeout: at c=32 an agent request waits for 31 others' 2k-token prefills on a CPU.
    results, wall = asyncio.run(
        run_level(url, variant, prompts, c, max_tokens=max_tokens, temperature=0.0, timeout_s=3600)
    )
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    return {
        "failed": len(results) - len(ok),
        "tok_s": round(tokens / wall, 3) if wall else None,
        "ttft_p50_s": percentile([r.ttft for r in ok], 50),
        "itl_p50_s": percentile([g for r in ok for g in r.gaps], 50),
        "texts": {r.index: r.text for r in ok},
    }


def sweep(url: str, args, method: Method, tokenizer) -> list[dict]:
    runs = []
    for rnd, order in method.each_round(VARIANTS):
        for workload in args.workloads:
            for c in args.concurrency:
                n = args.requests or max(4, 2 * c)
                prompts = workload_prompts(workload, n, args.seed + 1000 * c, tokenizer, args.code_tokens)
                for variant in order:
                    before = counters(url)
                    row = level(url, variant, prompts, c, args.max_tokens)
                    row["acceptance"] = acceptance(before, counters(url)) if variant == "spec-on" else None
                    runs.append({"round": rnd + 1, "workload": workload, "concurrency": c, "variant": variant, **row})
                    print(
                        f"round {rnd + 1} {workload:>8} c={c:<3} {variant}: tok/s {row['tok_s']} "
                        f"failed {row['failed']}",
                        flush=True,
                    )
    return runs


HEADER = (
    "workload | c | off tok/s (rounds) | on tok/s (rounds) | on / off, paired (rounds) | spread | "
    "TTFT p50 off / on s | ITL p50 off / on s | acceptance (rounds) | greedy text identical | failed"
)


def table(runs: list[dict], method: Method) -> tuple[list[dict], str]:
    """One row per workload and concurrency; the on/off ratio is checked against the spread."""
    rows, lines = [], []
    for key in dict.fromkeys((r["workload"], r["concurrency"]) for r in runs):
        same_level = [r for r in runs if (r["workload"], r["concurrency"]) == key]
        off = sorted((r for r in same_level if r["variant"] == "spec-off"), key=lambda r: r["round"])
        on = sorted((r for r in same_level if r["variant"] == "spec-on"), key=lambda r: r["round"])
        off_rate, on_rate = summarize([r["tok_s"] for r in off]), summarize([r["tok_s"] for r in on])
        ratio = summarize(paired_ratios([r["tok_s"] for r in on], [r["tok_s"] for r in off]))
        accepted = summarize([r["acceptance"] for r in on])
        method.check(f"{key[0]} c={key[1]} on/off", ratio)
        same, total = identical(off + on)
        row = {
            "workload": key[0],
            "concurrency": key[1],
            "off_tok_s": off_rate.as_dict(),
            "on_tok_s": on_rate.as_dict(),
            "on_over_off": ratio.as_dict(),
            "acceptance": accepted.as_dict(),
            "identical": [same, total],
            "failed": sum(r["failed"] for r in off + on),
        }
        rows.append(row)
        ttft = " / ".join(_p50(x, "ttft_p50_s") for x in (off, on))
        itl = " / ".join(_p50(x, "itl_p50_s") for x in (off, on))
        parity = f"{same}/{total}" + ("" if same == total else " NO")
        lines.append(
            [
                key[0],
                key[1],
                off_rate.cell(),
                on_rate.cell(),
                ratio.cell(3),
                method.flag_cell(ratio),
                ttft,
                itl,
                accepted.cell(),
                parity,
                row["failed"],
            ]
        )
    return rows, markdown_table(HEADER, lines)


def identical(runs: list[dict]) -> tuple[int, int]:
    """(prompts whose text was the same in every run of both variants, prompts)."""
    indices = sorted({i for r in runs for i in r["texts"]})
    same = sum(1 for i in indices if len({r["texts"].get(i) for r in runs}) == 1)
    return same, len(indices)


def _p50(runs: list[dict], key: str) -> str:
    value = summarize([r[key] for r in runs]).median
    return "" if value is None else f"{value:.3f}"


def counters(url: str) -> tuple[int, int]:
    """(drafted, accepted) tokens of the spec-on worker so far; (0, 0) when not reported."""
    workers = speculative_stats(url).get("workers") or []
    drafted = sum((w or {}).get("drafted_tokens", 0) for w in workers)
    return drafted, sum((w or {}).get("accepted_tokens", 0) for w in workers)


def acceptance(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """The share of drafted tokens accepted during one level."""
    drafted = after[0] - before[0]
    return round((after[1] - before[1]) / drafted, 3) if drafted > 0 else None


def worker_stats(url: str, name: str, key: str) -> list:
    """One entry of each of a variant's workers' /v1/status stats; [] when not reported."""
    try:
        with urllib.request.urlopen(f"{url.removesuffix('/v1')}/v1/status", timeout=10) as r:
            status = json.loads(r.read())
    except (OSError, ValueError):
        return []
    for model in status.get("models", []):
        if model.get("name") == name:
            return [(w.get("stats") or {}).get(key) for w in model.get("workers", [])]
    return []


def speculative_stats(url: str) -> dict:
    """The spec-on worker's speculative counters, when /v1/status reports them."""
    workers = worker_stats(url, "spec-on", "speculative")
    return {"workers": workers} if workers else {}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--concurrency", default="1,8,16,32")
    ap.add_argument("--workloads", default="distinct,fixed,agent")
    ap.add_argument("--requests", type=int, default=0, help="per level (default 2 x c, >= 4)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--code-tokens", type=int, default=2000, help="code per agent request")
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--max-rows", type=int, default=0, help="spec-on's speculative.max_rows (default: the device's)")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="rows per variant (default: the largest c)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    bench_method.add_arguments(ap)
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.seed = args.seed if args.seed is not None else int(time.time()) % (1 << 30)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    method = bench_method.from_args(args)
    model_dir = args.model_dir.expanduser().resolve()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    with tempfile.TemporaryDirectory(prefix="mlxgw-spec-") as tmp:
        rows = args.max_num_seqs or max(args.concurrency)
        server = start_gateway(model_dir, Path(tmp), rows, args)
        url = server.api
        try:
            server.wait_ready()
            for variant in VARIANTS:
                warm_up(url, variant)
            with method.busy_loops():
                runs = sweep(url, args, method, tokenizer)
            summary, md = table(runs, method)
            md = f"({method.header()}; greedy, {args.max_tokens} tokens, seed {args.seed})\n\n{md}\n\n" + "\n".join(
                log.line() for log in method.logs
            )
            print(md)
            stats = speculative_stats(url)
            # the BLAS thread counts each variant settled on (worker/model/cpu/blas_threads.py)
            blas = {v: worker_stats(url, v, "blas_threads") for v in VARIANTS}
        except Exception:
            show_log_tails([server])
            raise
        finally:
            stop_all([server])
    status = method.finish()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"config": {k: str(v) for k, v in vars(args).items()}, "method": method.as_dict(), "rows": summary}
        report["speculative_stats"] = stats
        report["blas_threads"] = blas
        report["runs"] = [{k: v for k, v in r.items() if k != "texts"} for r in runs]
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
        args.out.with_suffix(".md").write_text(md + "\n")
    if any(r["failed"] for r in summary):
        sys.exit(1)
    sys.exit(status)


if __name__ == "__main__":
    main()
