"""Where a decode step's time goes, mlxgw's engine beside mlx_lm.server's loop, in one run.

    python -m mlxgw.bench.step.breakdown [MODEL_DIR] --batches 1,8,16 --steps 40 --out step.json

Two engines on the same weights in one process (mlx_lm's loop on the model as mlx-lm loads
it, mlxgw's on the worker's, whose output head is stored transposed), taking turns in
blocks of --block steps at every batch size, so a change in the machine's load falls on both:
- mlxgw: the real worker Scheduler + MLXRunner (its batch-wide sampler; `--sampler both`
  also runs its per-row path), plus the msgpack encoding of each step's events;
- mlx_lm.server: its `_generate` loop's turn (bench/step/mlx_lm_loop.py): BatchGenerator.next()
  and the server's per-token work (detokenizer, logprob .item(), Response, queue).
Every row decodes (prompts of ~64 tokens, temperature 0.7, one sampler per request as each
server builds them); a row that finishes is replaced, and only steps in which the whole
batch decoded count. Each engine is timed twice:
- pipelined: the step as it runs (mlx-lm overlaps the next forward with the host work
  through mx.async_eval), timed around the step only;
- instrumented: timers around the pieces, each forced with mx.eval so its time is its own
  (so the pieces run one after the other and this step is a little longer):
  forward (the model call), sampling (logits processors + the batch's logsumexp + the draw),
  host (mlxgw: text stream, output parser, the scheduler's per-token events, msgpack;
  mlx_lm: the server's per-token loop), rest (batch bookkeeping nobody's timer covers).
- padding: the share of the attention's KV positions that are left padding (rows of
  different lengths padded to the longest, mlx-lm's BatchKVCache), in the counted steps;
- idle: time per step spent outside the step by the loop (admitting replacement rows).
  In-process there is no ZeroMQ to wait on, so this is the loop's own work, not waiting.
The floor (bench/step/floor.py): the larger of reading every weight once and the FLOPs at
the peak GEMM rate. Medians over the counted steps, with each block's median beside it
in the JSON. No project code is changed: the timers are wrappers installed in this process
only. Runs with the environment workers get (OpenBLAS)."""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from ..report import markdown_table
from ..stats import median, summarize
from .mlxgw_loop import PATHS, PIECES, MlxgwLoop, SamplerView, make_request
from .timers import Timers, install_timers

HOST = ("detokenize", "parse", "events", "encode", "host")
SAMPLING = ("processors", "normalize", "sampling")


def padding_share(decode_batch) -> float | None:
    """The share of the decode batch's attention KV positions that are left padding."""
    caches = getattr(decode_batch, "prompt_cache", None) or []
    cache = caches[0] if caches else None
    left, width = getattr(cache, "left_padding", None), getattr(cache, "_idx", 0)
    if left is None or not width:
        return None
    pads = left.tolist()
    return sum(pads) / (len(pads) * width) if pads else None


def measure_batch(loops: list, args, timers: Timers) -> list[dict]:
    """Every loop at one batch size: pipelined steps, then instrumented ones, the loops
    taking turns every args.block steps."""
    for loop in loops:
        loop.enter()
        for _ in range(args.warmup):
            loop.step()
    pipelined = _alternate(loops, args, lambda loop: loop.step())
    pieces: dict[str, list[dict[str, float]]] = {loop.name: [] for loop in loops}
    padding: dict[str, list[float]] = {loop.name: [] for loop in loops}

    def instrumented(loop):
        timers.step = defaultdict(float)
        wall, pure = loop.step()
        if pure:
            pieces[loop.name].append(loop.split(timers.step, wall))
            share = padding_share(loop.decode_batch())
            if share is not None:
                padding[loop.name].append(share)
        return wall, pure

    timers.on = True
    try:
        instrumented_walls = _alternate(loops, args, instrumented)
    finally:
        timers.on = False
    return [_row(loop.name, args.block, pipelined, instrumented_walls, pieces, padding) for loop in loops]


def _row(name: str, block: int, pipelined, instrumented_walls, pieces, padding) -> dict:
    walls, idle = pipelined[name]
    piece_ms = {k: _ms(median(s[k] for s in pieces[name]) or 0.0) for k in PIECES}
    blocks = summarize([median(b) for b in _blocks(walls, block)])
    return {
        "engine": name,
        "steps": len(walls),
        "step_ms": _ms(median(walls)),
        "step_ms_by_block": [_ms(v) for v in blocks.rounds],
        "step_block_spread": round(blocks.spread, 3) if blocks.spread is not None else None,
        "idle_ms": _ms(median(idle)),
        "instrumented_step_ms": _ms(median(instrumented_walls[name][0])),
        "pieces_ms": piece_ms,
        "sampling_ms": round(sum(piece_ms[k] for k in SAMPLING), 3),
        "host_ms": round(sum(piece_ms[k] for k in HOST), 3),
        "padding_share": round(median(padding[name]), 4) if padding[name] else None,
    }


def _blocks(values: list[float], size: int) -> list[list[float]]:
    size = max(1, size)
    return [values[i : i + size] for i in range(0, len(values), size)]


def _alternate(loops: list, args, one: Callable) -> dict[str, tuple[list[float], list[float]]]:
    """args.steps counted steps per loop, the loops taking turns every args.block steps:
    per loop, (step walls, idle before each counted step)."""
    walls: dict[str, tuple[list[float], list[float]]] = {loop.name: ([], []) for loop in loops}
    while any(len(w[0]) < args.steps for w in walls.values()):
        for loop in loops:
            loop.enter()
            got, idle = walls[loop.name]
            want = min(args.block, args.steps - len(got))
            attempts = 0
            while want > 0 and attempts < 4 * args.block:
                attempts += 1
                t0 = time.perf_counter()
                wall, pure = one(loop)
                if pure:
                    got.append(wall)
                    idle.append(max(0.0, time.perf_counter() - t0 - wall))
                    want -= 1
    return walls


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def load_runner(model_dir: Path, max_batch: int):
    from ...worker.process.build_mlx import build_mlx_runner

    runner = build_mlx_runner(
        model_dir, context_length=None, max_num_seqs=max_batch, prefill_step_size=512, cache_bytes=0
    )
    # The BLAS thread count is process-wide: mlxgw's policy would leave mlx_lm's turns at
    # whatever count it last tried. Both engines run at the BLAS's own count here.
    runner.blas = None
    return runner


SUMMARY = (
    "batch | engine | step ms (median; per block) | floor ms (bound) | step / floor | forward ms | "
    "forward / floor | padding | sampling ms | host ms | rest ms | idle ms | instrumented ms | GEMM GFLOP/s"
)


def _summary_cells(r: dict) -> list[str]:
    pad = "" if r["padding_share"] is None else f"{r['padding_share']:.1%}"
    blocks = ", ".join(f"{v:.0f}" for v in r["step_ms_by_block"])
    forward = r["pieces_ms"]["forward"]
    return [
        r["batch"],
        r["engine"],
        f"{r['step_ms']:.1f} ({blocks})",
        f"{r['floor_ms']:.1f} ({r['bound']})",
        f"{r['step_ms'] / r['floor_ms']:.2f}x",
        f"{forward:.1f}",
        f"{forward / r['floor_ms']:.2f}x",
        pad,
        f"{r['sampling_ms']:.2f}",
        f"{r['host_ms']:.2f}",
        f"{r['pieces_ms']['rest']:.2f}",
        f"{r['idle_ms']:.2f}",
        f"{r['instrumented_step_ms']:.1f}",
        f"{r['gemm_gflops']:.0f}",
    ]


def markdown(rows: list[dict], meta: dict) -> str:
    pieces = ([r["batch"], r["engine"], *(f"{r['pieces_ms'][k]:.2f}" for k in PIECES)] for r in rows)
    lines = [
        markdown_table(SUMMARY, map(_summary_cells, rows)),
        "",
        markdown_table(["batch", "engine", *PIECES], pieces),
    ]
    f = meta["floors"]
    lines += [
        "",
        f"Model {meta['model']} ({f['parameters'] / 1e6:.1f}M parameters, {meta['dtype']}, "
        f"{f['weight_bytes'] / 1e6:.0f} MB), prompts ~{meta['prompt_tokens']} tokens, temperature "
        f"{meta['temperature']}, frequency penalty {meta['frequency_penalty']}, {meta['steps']} counted steps per "
        f"engine and batch in turns of {meta['block']} (medians), BLAS preload: {meta['ld_preload'] or 'none'}; "
        f"every weight read once in {f['weight_read_ms']:.1f} ms ({f['read_gb_s']:.1f} GB/s), peak GEMM rate "
        f"{f['peak_gemm_gflops']:.0f} GFLOP/s (batch {f['peak_batch']}); load average {meta['load_start']} -> "
        f"{meta['load_end']}.",
    ]
    return "\n".join(lines)


def default_model_dir() -> Path:
    from ...shared.paths import models_dir

    return models_dir() / "smollm2-135m"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", type=Path, default=None)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--steps", type=int, default=40, help="counted steps per batch and engine")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=22, help="~64 prompt tokens with the chat template")
    ap.add_argument(
        "--prompt-words-max",
        type=int,
        default=None,
        help="draw each prompt's length up to this many words: rows of different lengths, so padding shows",
    )
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="non-zero: every row runs a logits processor")
    ap.add_argument("--stop", action="append", default=None, help="stop strings (default: one that never matches)")
    ap.add_argument("--gemm-repeats", type=int, default=20)
    ap.add_argument("--peak-batch", type=int, default=256, help="batch at which the peak GEMM rate is measured")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--engines",
        default="mlxgw,mlx_lm",
        help="comma-separated: mlxgw (its batch-wide sampler), mlxgw-per-row (its per-row path), "
        "mlxgw-normalise-all (log-softmax of every row, as before 2026-12-02), mlxgw-mlx-attention (mlx-lm's "
        "attention instead of worker/model/cpu/cpu_attention.py, as before 2026-12-02), mlx_lm (mlx_lm.server's loop)",
    )
    ap.add_argument("--block", type=int, default=10, help="steps per turn when alternating engines")
    ap.add_argument(
        "--sampling-only",
        type=int,
        default=0,
        metavar="REPEATS",
        help="time only normalize + sampling (+ the frequency penalty, if set) per-row vs batched "
        "on random logits, this many alternating repeats per batch; no model is run",
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    args = ap.parse_args(argv)
    args.stop = args.stop if args.stop is not None else ["<<never-matches>>"]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - {*PATHS, "mlx_lm"}
    if unknown:
        ap.error(f"unknown engine(s): {', '.join(sorted(unknown))}")
    return args


def make_loops(names: list[str], runner, peer_model, batch: int, args, timers: Timers) -> list:
    """The engines to alternate at one batch size; mlxgw's sampler paths share one Scheduler."""
    from ..loadgen import varied_prompts
    from .mlx_lm_loop import MlxLmLoop

    prompts = varied_prompts(4 * batch + 64, args.prompt_words, args.seed, args.prompt_words_max)
    loops: list = []
    mlxgw: MlxgwLoop | None = None
    for name in names:
        if name == "mlx_lm":
            loops.append(MlxLmLoop(peer_model, runner.tokenizer, batch, args, timers, prompts))
        elif mlxgw is None:
            mlxgw = MlxgwLoop(runner, batch, args, timers, prompts, path=name)
            loops.append(mlxgw)
        else:
            loops.append(SamplerView(mlxgw, path=name))
    return loops


def main(argv: list[str] | None = None) -> None:
    from ...shared.platform import reexec_as_worker

    reexec_as_worker("mlxgw.bench.step.breakdown")
    args = parse_args(argv)
    import os

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..loadgen import varied_prompts
    from ..method import load_average
    from .floor import Floors

    model_dir = args.model_dir or default_model_dir()
    batches = [int(b) for b in args.batches.split(",")]
    if args.sampling_only:
        from .sampling import sampling_only

        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        sampling_only(batches, vocab, args.sampling_only, args.frequency_penalty)
        return
    load_start = load_average()
    runner = load_runner(model_dir, max(batches))
    timers = Timers()
    install_timers(timers, runner, mx)
    # mlx_lm.server's loop gets the model as mlx-lm loads it: the worker stores its output
    # head transposed (worker/model/cpu/output_head.py), a layout of its own. Same weights, same BLAS.
    from mlx_lm import load

    from .timers import TimedModel

    peer_model = TimedModel(load(str(model_dir))[0], timers, mx) if "mlx_lm" in args.engines else None
    floors = Floors.measure(runner.model, mx, args.gemm_repeats, args.peak_batch)
    rows = []
    for batch in batches:
        loops = make_loops(args.engines, runner, peer_model, batch, args, timers)
        try:
            measured = measure_batch(loops, args, timers)
        finally:
            for loop in loops:
                loop.close()
        floor = floors.row(runner.model, batch, mx, args.gemm_repeats)
        for row in measured:
            row = {"batch": batch, **row, **floor}
            rows.append(row)
            print(json.dumps(row), flush=True)
    sample = make_request("probe", varied_prompts(1, args.prompt_words, args.seed)[0], 1, 0.7, [])
    meta = {
        "model": str(model_dir.name),
        "dtype": str(tree_flatten(runner.model.parameters())[0][1].dtype),
        "prompt_tokens": len(runner.encode(sample)),
        "temperature": args.temperature,
        "frequency_penalty": args.frequency_penalty,
        "steps": args.steps,
        "block": args.block,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "floors": floors.as_dict(),
        "load_start": load_start,
        "load_end": load_average(),
    }
    print(markdown(rows, meta))
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
