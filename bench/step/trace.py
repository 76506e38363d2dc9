"""Where a served worker's steps went: a summary of the step traces of worker/model/runners/step_trace.py.

    MLXGW_STEP_TRACE=TRACE_DIR python -m mlxgw.bench.speculation.matrix ... --max-rows 16
    python -m mlxgw.bench.step.trace TRACE_DIR

Every worker started with MLXGW_STEP_TRACE=FOLDER wrote FOLDER/<pid>.jsonl, one line per
engine step. A step's cost is the time from its start to the next one's (host work after it
included, as bench/method.py's servers are timed), and a level of a closed-loop bench ends
where the batch drains (a step after which no row is decoding). Per worker and level:
the decode steps' cost per generated token, plain and speculative apart, by batch size (a
power of two, as the speculator buckets them), the steps that also read a prompt kept apart
(their cost is mostly the prompt's); the wall time the verifications took beyond what plain
steps would have taken for the same tokens; and the attention's padding share. Then two
tables over every level:
- verifications against plain decode steps by batch size (the speculating workers' steps
  that read no prompt): the cost per generated token of each, and the tokens a row gained
  per verification (bench/HISTORY.md at 3b9d616, "Speculation's cost at 8-16 rows");
- the BLAS thread counts (worker/model/cpu/blas_threads.py) per worker: the steps run at fewer than the
  most threads, and the time they took beyond the other count's rate per position fed, for
  the same kind of step (decode rows to a power of two, reading a prompt or not)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..report import markdown_table
from ..stats import median


def load(path: Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    header = lines[0].get("header", {}) if lines else {}
    return header, [s for s in lines[1:] if "t" in s]


def levels(steps: list[dict]) -> list[list[dict]]:
    """Steps cut where the batch drained; each step gets `cost`, start to next start."""
    out, current = [], []
    for step, after in zip(steps, steps[1:] + [None]):
        ends = step["rows_after"] == 0
        step["cost"] = step["next_s"] if ends or after is None else after["t"] - step["t"]
        current.append(step)
        if ends:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return [lv for lv in out if sum(s["emitted"] for s in lv) > 0]


def bucket(rows: int) -> int:
    return 1 << max(0, rows - 1).bit_length()


def per_token(steps: list[dict]) -> float | None:
    tokens = sum(s["emitted"] for s in steps)
    return sum(s["cost"] for s in steps) / tokens if tokens else None


def summarize_level(steps: list[dict]) -> dict:
    decode = [s for s in steps if s["emitted"] and not s["read"]]
    by_size: dict[int, dict] = {}
    for size in sorted({bucket(s["rows"]) for s in decode}):
        plain = [s for s in decode if not s["spec"] and bucket(s["rows"]) == size]
        spec = [s for s in decode if s["spec"] and bucket(s["rows"]) == size]
        by_size[size] = {
            "plain_steps": len(plain),
            "plain_ms_per_token": _ms(per_token(plain)),
            "spec_steps": len(spec),
            "spec_ms_per_token": _ms(per_token(spec)),
        }
    spec_steps = [s for s in steps if s["spec"]]
    plain_rate = per_token([s for s in decode if not s["spec"]])
    spec_time = sum(s["cost"] for s in spec_steps)
    extra = spec_time - plain_rate * sum(s["emitted"] for s in spec_steps) if plain_rate else None
    wall = steps[-1]["t"] + steps[-1]["next_s"] - steps[0]["t"]
    padded = [1 - s["held"] / (s["rows_after"] * s["width"]) for s in steps if s["rows_after"] and s["width"]]
    return {
        "steps": len(steps),
        "wall_s": round(wall, 2),
        "tokens": sum(s["emitted"] for s in steps),
        "prompt_tokens": sum(s["read"] for s in steps),
        "spec_steps": len(spec_steps),
        "spec_share_of_wall": round(spec_time / wall, 3) if wall else None,
        "spec_extra_s": None if extra is None else round(extra, 2),
        "padding_share": round(sum(padded) / len(padded), 3) if padded else None,
        "rows_median": median([s["rows"] for s in steps]),
        "by_size": by_size,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 2)


def _workers(folder: Path) -> list[tuple[str, list[dict], list[list[dict]]]]:
    """Each trace of the folder, read once: (its worker's name, its steps, their levels)."""
    out = []
    for path in sorted(folder.glob("*.jsonl")):
        header, steps = load(path)
        out.append((f"{path.stem} ({header.get('speculative', '?')})", steps, levels(steps)))
    return out


def report(folder: Path, workers: list | None = None) -> tuple[list[dict], str]:
    header = (
        "worker | level | tok/s | steps (verifications) | verifications' share of wall | "
        "their cost beyond plain s | padding | decode ms/token plain / verifying, by batch size"
    )
    rows, lines = [], []
    for name, _, worker_levels in _workers(folder) if workers is None else workers:
        for i, level in enumerate(worker_levels, 1):
            s = summarize_level(level)
            rows.append({"worker": name, "level": i, **s})
            sizes = "; ".join(
                f"{size}: {v['plain_ms_per_token']} / {v['spec_ms_per_token']} ({v['plain_steps']}/{v['spec_steps']})"
                for size, v in s["by_size"].items()
            )
            rate = round(s["tokens"] / s["wall_s"], 1) if s["wall_s"] else None
            steps = f"{s['steps']} ({s['spec_steps']})"
            lines.append([name, i, rate, steps, s["spec_share_of_wall"], s["spec_extra_s"], s["padding_share"], sizes])
    return rows, markdown_table(header, lines)


def verification_table(workers: list) -> str:
    header = (
        "rows | plain steps | plain ms/token | verifications | verifying ms/token | verifying / plain | "
        "tokens per row per verification"
    )
    lines = []
    steps = [s for name, w, _ in workers if "(off)" not in name for s in w if s["emitted"] and not s["read"]]
    for size in sorted({bucket(s["rows"]) for s in steps}):
        plain = [s for s in steps if not s["spec"] and bucket(s["rows"]) == size]
        spec = [s for s in steps if s["spec"] and bucket(s["rows"]) == size]
        p, v = per_token(plain), per_token(spec)
        gained = sum(s["emitted"] for s in spec) / sum(s["rows"] for s in spec) if spec else None
        ratio = f"{v / p:.2f}" if p and v else ""
        gained_cell = "" if gained is None else f"{gained:.2f}"
        lines.append([size, len(plain), _ms(p) or "", len(spec), _ms(v) or "", ratio, gained_cell])
    return markdown_table(header, lines)


def threads_table(workers: list) -> str:
    header = (
        "worker | steps | at fewer threads | prompt-reading steps at fewer threads | busy s | "
        "beyond the other count's rate s"
    )
    lines = []
    for name, steps, _ in workers:
        active = [s for s in steps if (s["rows"] or s["read"]) and s.get("threads")]
        if not active:
            continue
        most = max(s["threads"] for s in active)
        kinds: dict[tuple, list[dict]] = {}
        for s in active:
            if not s["spec"]:
                kinds.setdefault((bucket(s["rows"]) if s["rows"] else 0, s["read"] > 0), []).append(s)
        beyond = 0.0
        for kind_steps in kinds.values():
            full = [s for s in kind_steps if s["threads"] == most]
            fewer = [s for s in kind_steps if s["threads"] != most]
            if full and fewer:
                rate = sum(s["cost"] for s in full) / sum(s["rows"] + s["read"] for s in full)
                beyond += sum(s["cost"] - rate * (s["rows"] + s["read"]) for s in fewer)
        busy = sum(s["cost"] for s in active)
        fewer_steps = sum(s["threads"] != most for s in active)
        prompts = [s for s in active if s["read"]]
        lines.append(
            [
                name,
                len(active),
                f"{fewer_steps} ({fewer_steps / len(active):.1%})",
                f"{sum(s['threads'] != most for s in prompts)} of {len(prompts)}",
                f"{busy:.1f}",
                f"{beyond:.1f} ({beyond / busy:.1%})",
            ]
        )
    return markdown_table(header, lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json")
    args = ap.parse_args(argv)
    workers = _workers(args.folder)
    rows, md = report(args.folder, workers)
    print(md, verification_table(workers), threads_table(workers), sep="\n\n")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
