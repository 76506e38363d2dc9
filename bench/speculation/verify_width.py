"""What a speculative verification costs against a plain decode step, by batch and width.

A verification is one forward of (rows x width) positions, width = 1 + the longest draft in
the batch (worker/model/speculation/spec_verify.py): every row pays the widest row's positions. Where a
forward's cost grows with its positions (a CPU at batch 8-16), a verification pays only if
the batch as a whole emits that many times the tokens of a plain step. This times the
worker's own model (MLXRunner: its attention and head) on a cache of ~100 positions per
row, the widths alternated, medians; the cache is trimmed after every call so the context
stays put.

    python -m mlxgw.bench.speculation.verify_width MODEL_DIR --batches 1,8,16 --widths 1,2,3,5,9
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def width_costs(model, batch: int, widths: list[int], repeats: int, context: int) -> dict[int, float]:
    """Median seconds of one forward per width, at this batch, after `context` positions."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, 1000, (batch, context)), cache=cache))
    times: dict[int, list[float]] = {w: [] for w in widths}
    for repeat in range(repeats + 2):  # the first two of each are warm-ups
        for width in widths if repeat % 2 == 0 else widths[::-1]:
            x = mx.random.randint(0, 1000, (batch, width))
            started = time.perf_counter()
            mx.eval(model(x, cache=cache))
            if repeat >= 2:
                times[width].append(time.perf_counter() - started)
            for layer in cache:
                layer.trim(width)
    return {w: statistics.median(t) for w, t in times.items()}


def main() -> None:
    from ...shared.platform import reexec_as_worker

    reexec_as_worker("mlxgw.bench.speculation.verify_width")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--widths", default="1,2,3,5,9", help="positions per row; the first is the plain step")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--context", type=int, default=100, help="cached positions per row")
    args = ap.parse_args()
    from ...worker.process.build_mlx import build_mlx_runner

    batches = [int(b) for b in args.batches.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    runner = build_mlx_runner(
        str(args.model_dir), context_length=None, max_num_seqs=max(batches), prefill_step_size=512, cache_bytes=0
    )
    print("| batch | " + " | ".join(f"width {w}" for w in widths) + " |")
    print("|---|" + "---|" * len(widths))
    for batch in batches:
        costs = width_costs(runner.model, batch, widths, args.repeats, args.context)
        plain = costs[widths[0]]
        cells = [f"{1e3 * costs[w]:.1f} ms ({costs[w] / plain:.2f}x)" for w in widths]
        print(f"| {batch} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
