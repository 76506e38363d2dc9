"""Where a decode step's time goes: the real worker Scheduler + MLXRunner, in-process.

    python -m mlxgw.bench.step_breakdown [MODEL_DIR] --batches 1,8,16,32 --out step.json

Every row decodes (prompts of ~64 tokens, temperature 0.7, one sampler per request as the
worker builds them). Each batch size is measured twice on the same runner:
- pipelined: the step as it runs in a worker (mlx-lm overlaps the next forward with the
  host work through mx.async_eval), timed around Scheduler.step only;
- instrumented: timers wrapped around the pieces (the model call, each logits processor,
  each sampler, the text stream, the output parser, the scheduler's per-token work and the
  msgpack encoding of the step's events), each forced with mx.eval so its time is its own.
  The pieces then run one after the other, so this step is a little longer than the
  pipelined one; "normalize" is the batch's logsumexp before sampling; "rest" is what no
  timer covers (mlx-lm's batch bookkeeping and per-row concatenates, admission checks,
  TokenOut building). "encode" is the msgpack frame the engine sends per step (no ZeroMQ
  here, and no idle time: the loop never waits for messages).
Only steps where the whole batch decoded (no prefill, no row finished) count; a finished row
is replaced by a new request so the batch stays full. Medians over the counted steps.

--sampler both (the default) measures the two sampler paths of the same runner, taking turns
every --block steps on the same batch: "batched" (worker/batch_sampler.py: one sampling and
one penalty call per step for the whole batch) and "per-row" (mlx-lm's own step, one
sampler call per row: the path before it). "sampling" and "processors" then time the batched
calls or the per-row calls, whichever ran.

The compute floor: 2 FLOPs per parameter per token x batch, at the rate mx.matmul reaches on
this machine for the model's own weight shapes in float32 (all of one forward's weight GEMMs
evaluated as one graph, fastest of repeats), both at each batch size (small batches are
bound by memory bandwidth, so that floor is a bandwidth floor) and at a large batch (the
peak rate: "floor at peak"). No project code is changed: the timers are
wrappers installed in this process only. Runs with the environment workers get (OpenBLAS)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

PIECES = ["forward", "processors", "normalize", "sampling", "detokenize", "parse", "events", "encode", "rest"]


class Timers:
    """Accumulates seconds per piece within one step; on only while instrumenting."""

    def __init__(self) -> None:
        self.on = False
        self.step: dict[str, float] = defaultdict(float)

    def add(self, piece: str, seconds: float) -> None:
        self.step[piece] += seconds

    def timed(self, piece: str, fn: Callable, force: Callable | None = None) -> Callable:
        """fn, timed under `piece` while on; force(result) makes lazy MLX results count."""

        def wrapper(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if force is not None:
                force(out)
            self.add(piece, time.perf_counter() - t0)
            return out

        return wrapper


class TimedModel:
    """The model, with its call evaluated and timed as the forward pass."""

    def __init__(self, model, timers: Timers, mx):
        self._model = model
        self._call = timers.timed("forward", model, mx.eval)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def install_timers(timers: Timers, runner, mx) -> None:
    """Wrap the pieces of a step (once per process); everything else runs as shipped."""
    from mlxgw.shared import protocol as p
    from mlxgw.worker import output_parser, sampling, textstream
    from mlxgw.worker.batch_sampler import VectorGenerationBatch

    timed_model = TimedModel(runner.generator.model, timers, mx)
    # The decode batch holds its own reference, taken when the generator was built.
    runner.generator.model = runner.generator._generation_batch.model = timed_model

    def normalized_first(sample):
        """sample, with the batch's logsumexp evaluated outside its timer (it is not sampling)."""

        def run(self, logprobs, *rest):
            if timers.on:
                t0 = time.perf_counter()
                mx.eval(logprobs)
                timers.add("normalize", time.perf_counter() - t0)
            return timers.timed("sampling", sample, mx.eval)(self, logprobs, *rest)

        return run

    # Per-row path (mlx-lm's own step): each row's sampler and processors, one call per row.
    # Class attributes, so the objects stay the RowSampling/RowPenalties the batched step uses.
    sampling.RowSampling.__call__ = normalized_first(sampling.RowSampling.__call__)
    sampling.RowPenalties.__call__ = timers.timed("processors", sampling.RowPenalties.__call__, mx.eval)
    guarded = sampling.guarded_processors
    sampling.guarded_processors = lambda *a, **k: [
        f if isinstance(f, sampling.RowPenalties) else timers.timed("processors", f, mx.eval) for f in guarded(*a, **k)
    ]
    # Batched path: one call each per step.
    VectorGenerationBatch.sample = normalized_first(VectorGenerationBatch.sample)
    VectorGenerationBatch.process = timers.timed(
        "processors", VectorGenerationBatch.process, lambda out: mx.eval(out[0])
    )
    for name in ("push", "finish"):
        setattr(textstream.TextStream, name, timers.timed("detokenize", getattr(textstream.TextStream, name)))
    parser_cls = output_parser.OutputParser
    for name in ("feed", "finish"):
        if hasattr(parser_cls, name):
            setattr(parser_cls, name, timers.timed("parse", getattr(parser_cls, name)))
    p.encode = timers.timed("encode", p.encode)


def make_request(
    rid: str, messages: list[dict], max_tokens: int, temperature: float, stop: list[str], penalty: float = 0.0
):
    from mlxgw.shared import protocol as p

    return p.GenerateRequest(
        rid=rid,
        messages=messages,
        sampling=p.SamplingParams(temperature=temperature, frequency_penalty=penalty),
        max_tokens=max_tokens,
        stop=stop,
    )


class Workload:
    """Keeps `batch` rows decoding: a row that finishes is replaced by a fresh request."""

    def __init__(self, scheduler, batch: int, args):
        from .loadgen import varied_prompts

        self.scheduler, self.batch, self.args = scheduler, batch, args
        self.prompts = varied_prompts(4 * batch + 64, args.prompt_words, args.seed)
        self.next_prompt = 0
        self.live: set[str] = set()

    def top_up(self) -> None:
        from mlxgw.shared import protocol as p

        while len(self.live) < self.batch:
            i = self.next_prompt
            self.next_prompt += 1
            rid = f"b{self.batch}-{i}"
            req = make_request(
                rid,
                self.prompts[i % len(self.prompts)],
                self.args.max_tokens,
                self.args.temperature,
                self.args.stop,
                self.args.frequency_penalty,
            )
            for _, ev in self.scheduler.submit(req):
                if ev.get("e") == p.EV_ERROR:
                    raise RuntimeError(f"request refused: {ev}")
            self.live.add(rid)

    def step(self, encode) -> tuple[float, bool]:
        """One scheduler step (plus the engine's encoding of its events): seconds, and
        whether it was a pure decode step of the full batch."""
        from mlxgw.shared import protocol as p

        self.top_up()
        before = self.scheduler.running
        t0 = time.perf_counter()
        events = self.scheduler.step()
        if events:
            encode(p.EVENTS, items=events)
        wall = time.perf_counter() - t0
        ended = {rid for rid, ev in events if ev.get("e") in (p.EV_FINISH, p.EV_ERROR)}
        self.live -= ended
        decoding = sum(1 for s in self.scheduler._seqs.values() if s.phase == "decode")
        progress = any(ev.get("e") == p.EV_PROGRESS for _, ev in events)
        pure = before == self.batch and decoding + len(ended) == self.batch and not ended and not progress
        return wall, pure


SAMPLERS = {"batched": True, "per-row": False}  # runner.generator.vectorized


def measure_batch(runner, batch: int, args, timers: Timers) -> list[dict]:
    """One row per sampler path; the paths alternate in blocks of steps on the same batch,
    so load changes on the machine fall on both alike."""
    from mlxgw.shared import protocol as p
    from mlxgw.worker.scheduler import Scheduler

    modes = args.samplers
    scheduler = Scheduler(runner, max_num_seqs=batch, max_queue=4 * batch)
    runner.generator.completion_batch_size = batch
    runner.generator.prefill_batch_size = batch
    # _on_token's time is the scheduler's per-token work; the text stream and parser it calls
    # are subtracted from it in _split.
    scheduler._on_token = timers.timed("events", scheduler._on_token)
    work = Workload(scheduler, batch, args)
    for _ in range(args.warmup):
        work.step(p.encode)
    pipelined = _alternate(runner, work, args, lambda mode: work.step(p.encode))
    timers.on = True
    pieces: dict[str, list[dict[str, float]]] = {m: [] for m in modes}

    def instrumented(mode):
        timers.step = defaultdict(float)
        wall, pure = work.step(p.encode)
        if pure:
            pieces[mode].append(_split(timers.step, wall))
        return wall, pure

    instrumented_walls = _alternate(runner, work, args, instrumented)
    timers.on = False
    runner.generator.vectorized = True
    for rid in list(work.live):
        scheduler.cancel(rid)
    return [
        {
            "batch": batch,
            "sampler": m,
            "steps": len(pipelined[m]),
            "step_ms": _ms(statistics.median(pipelined[m])),
            "instrumented_step_ms": _ms(statistics.median(instrumented_walls[m])),
            "pieces_ms": {k: _ms(statistics.median(s[k] for s in pieces[m])) for k in PIECES},
        }
        for m in modes
    ]


def _alternate(runner, work: Workload, args, one: Callable[[str], tuple[float, bool]]) -> dict[str, list[float]]:
    """args.steps counted steps per sampler path, the paths taking turns every args.block steps."""
    walls: dict[str, list[float]] = {m: [] for m in args.samplers}
    while any(len(w) < args.steps for w in walls.values()):
        for mode in args.samplers:
            runner.generator.vectorized = SAMPLERS[mode]
            want = min(args.block, args.steps - len(walls[mode]))
            walls[mode] += _collect(work, want, lambda mode=mode: one(mode))
    return walls


def _collect(work: Workload, steps: int, one: Callable[[], tuple[float, bool]]) -> list[float]:
    walls: list[float] = []
    attempts = 0
    while len(walls) < steps and attempts < 4 * steps:
        attempts += 1
        wall, pure = one()
        if pure:
            walls.append(wall)
    return walls


def _split(acc: dict[str, float], wall: float) -> dict[str, float]:
    out = {k: acc.get(k, 0.0) for k in PIECES}
    # _on_token's timer includes the text stream and the parser it calls.
    out["events"] = max(0.0, out["events"] - out["detokenize"] - out["parse"])
    out["rest"] = max(0.0, wall - sum(out[k] for k in PIECES if k != "rest"))
    return out


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


# -- the compute floor ------------------------------------------------------------------------
def weight_shapes(model) -> list[tuple[int, int]]:
    """(out, in) of every matrix a decode token multiplies by (the tied embedding is the head)."""
    from mlx.utils import tree_flatten

    shapes = [tuple(w.shape) for name, w in tree_flatten(model.parameters()) if w.ndim == 2]
    return shapes  # embed_tokens appears once; tied, it is the lm_head GEMM


def gemm_rate(model, batch: int, mx, repeats: int) -> tuple[float, float]:
    """(seconds for one forward's weight GEMMs at this batch, FLOP/s) with mx.matmul: the
    fastest of the repeats, since a floor is what the machine can do (it is shared)."""
    from mlx.utils import tree_flatten

    weights = [w for _, w in tree_flatten(model.parameters()) if w.ndim == 2]
    inputs = {w.shape[1]: mx.random.normal((batch, w.shape[1])).astype(w.dtype) for w in weights}
    mx.eval(list(inputs.values()))
    flops = sum(2 * batch * w.shape[0] * w.shape[1] for w in weights)
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        mx.eval([mx.matmul(inputs[w.shape[1]], w.T) for w in weights])
        times.append(time.perf_counter() - t0)
    best = min(times[2:])
    return best, flops / best


def load_runner(model_dir: Path, max_batch: int):
    from mlxgw.worker.runner import MLXRunner

    return MLXRunner(model_dir, context_length=None, max_num_seqs=max_batch, prefill_step_size=512, cache_bytes=0)


def markdown(rows: list[dict], meta: dict) -> str:
    head = (
        "| batch | sampler | step ms (pipelined) | floor ms | step / floor | floor at peak ms | instrumented ms | "
        + " | ".join(PIECES)
        + " | GEMM GFLOP/s |"
    )
    lines = [head, "|" + "---|" * (len(PIECES) + 8)]
    for r in rows:
        pieces = " | ".join(f"{r['pieces_ms'][k]:.2f}" for k in PIECES)
        lines.append(
            f"| {r['batch']} | {r['sampler']} | {r['step_ms']:.1f} | {r['floor_ms']:.1f} | "
            f"{r['step_ms'] / r['floor_ms']:.1f}x | "
            f"{r['peak_floor_ms']:.1f} | "
            f"{r['instrumented_step_ms']:.1f} | {pieces} | {r['gemm_gflops']:.0f} |"
        )
    lines.append("")
    lines.append(
        f"Model {meta['model']} ({meta['parameters'] / 1e6:.1f}M parameters, {meta['dtype']}), "
        f"prompts ~{meta['prompt_tokens']} tokens, temperature {meta['temperature']}, "
        f"frequency penalty {meta['frequency_penalty']}, "
        f"{meta['steps']} counted steps per batch (medians), BLAS preload: {meta['ld_preload'] or 'none'}; "
        f"peak GEMM rate {meta['peak_gemm_gflops']:.0f} GFLOP/s (batch {meta['peak_batch']})."
    )
    return "\n".join(lines)


def _sampling_case(batch: int, vocab: int, penalty: float) -> dict[str, Callable]:
    """One step's processors + normalize + sampling on random logits, both ways: mlx-lm's
    step (processors row by row, one logsumexp, one sampler call per row) and the batched."""
    import mlx.core as mx
    from mlxgw.shared.protocol import SamplingParams
    from mlxgw.worker.batch_sampler import PenaltyPlan, SamplePlan, apply_penalties, sample_rows
    from mlxgw.worker.sampling import RowPenalties, RowSampling

    params = SamplingParams(temperature=0.7, frequency_penalty=penalty)
    rows = tuple(RowSampling(params) for _ in range(batch))
    penalties = tuple(RowPenalties(params) for _ in range(batch)) if penalty else ()
    contexts = [mx.random.randint(0, vocab, (120,)) for _ in range(batch)]
    logits = mx.random.normal((batch, vocab)) * 3
    mx.eval(logits, contexts)
    plan = SamplePlan.build(rows)
    penalty_plan = PenaltyPlan.build(penalties, list(range(batch)), batch) if penalty else None

    def per_row() -> mx.array:
        x = logits
        if penalties:
            x = mx.concatenate([penalties[e](contexts[e], logits[e : e + 1]) for e in range(batch)])
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
        return mx.concatenate([rows[e](x[e : e + 1]) for e in range(batch)])

    def batched() -> mx.array:
        x = apply_penalties(logits, penalty_plan, contexts) if penalty_plan else logits
        return sample_rows(x - mx.logsumexp(x, axis=-1, keepdims=True), plan)

    return {"per-row": per_row, "batched": batched}


def sampling_only(batches: list[int], vocab: int, repeats: int, penalty: float) -> list[dict]:
    """The sampling (and, with a penalty, processor) work of one step alone, on random
    logits of the model's width, the two paths taking turns every repeat (medians, ms).
    Much less noisy than whole steps on a loaded machine."""
    import mlx.core as mx

    out = []
    for batch in batches:
        case = _sampling_case(batch, vocab, penalty)
        # Wall time, and the CPU time this process spent (less sensitive to other load).
        times: dict[str, list[float]] = {f"{name} {kind}": [] for name in case for kind in ("wall", "cpu")}
        for _ in range(repeats):
            for name, fn in case.items():
                t0, c0 = time.perf_counter(), time.process_time()
                mx.eval(fn())
                times[f"{name} wall"].append(time.perf_counter() - t0)
                times[f"{name} cpu"].append(time.process_time() - c0)
        row = {"batch": batch, **{k: _ms(statistics.median(v)) for k, v in times.items()}}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def default_model_dir() -> Path:
    from mlxgw.shared.paths import models_dir

    return models_dir() / "smollm2-135m"


def main() -> None:
    from mlxgw.shared.platform import reexec_as_worker

    reexec_as_worker("mlxgw.bench.step_breakdown")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", type=Path, default=None)
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--steps", type=int, default=40, help="counted steps per batch and mode")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=22, help="~64 prompt tokens with the chat template")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="non-zero: every row runs a logits processor")
    ap.add_argument("--stop", action="append", default=None, help="stop strings (default: one that never matches)")
    ap.add_argument("--gemm-repeats", type=int, default=20)
    ap.add_argument("--peak-batch", type=int, default=256, help="batch at which the peak GEMM rate is measured")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--sampler",
        default="both",
        choices=["both", *SAMPLERS],
        help="batched: the batch-wide sampler and penalties (worker/batch_sampler.py); per-row: "
        "mlx-lm's own step, one sampler call per row (the path before it); both: alternate them",
    )
    ap.add_argument("--block", type=int, default=10, help="steps per turn when alternating sampler paths")
    ap.add_argument(
        "--sampling-only",
        type=int,
        default=0,
        metavar="REPEATS",
        help="time only normalize + sampling (+ the frequency penalty, if set) per-row vs batched "
        "on random logits, this many alternating repeats per batch; no model is run",
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    args = ap.parse_args()
    args.stop = args.stop if args.stop is not None else ["<<never-matches>>"]
    args.samplers = list(SAMPLERS) if args.sampler == "both" else [args.sampler]
    import os

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from .loadgen import varied_prompts

    model_dir = args.model_dir or default_model_dir()
    batches = [int(b) for b in args.batches.split(",")]
    if args.sampling_only:
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        sampling_only(batches, vocab, args.sampling_only, args.frequency_penalty)
        return
    runner = load_runner(model_dir, max(batches))
    weights = [w for _, w in tree_flatten(runner.model.parameters())]
    params = sum(w.size for w in weights)
    dtype = str(weights[0].dtype)
    timers = Timers()
    install_timers(timers, runner, mx)
    sample = make_request("probe", varied_prompts(1, args.prompt_words, args.seed)[0], 1, 0.7, [])
    # The rate GEMMs reach when they are compute-bound: the floor no batching trick can beat.
    _, peak = gemm_rate(runner.model, args.peak_batch, mx, args.gemm_repeats)
    rows = []
    for batch in batches:
        measured = measure_batch(runner, batch, args, timers)
        gemm_s, rate = gemm_rate(runner.model, batch, mx, args.gemm_repeats)
        for row in measured:
            row["gemm_gflops"] = round(rate / 1e9, 1)
            row["gemm_ms"] = _ms(gemm_s)
            row["floor_ms"] = round(2 * params * batch / rate * 1000, 3)
            row["peak_floor_ms"] = round(2 * params * batch / peak * 1000, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {
        "model": str(model_dir.name),
        "parameters": params,
        "dtype": dtype,
        "prompt_tokens": len(runner.encode(sample)),
        "temperature": args.temperature,
        "frequency_penalty": args.frequency_penalty,
        "steps": args.steps,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "peak_batch": args.peak_batch,
        "peak_gemm_gflops": round(peak / 1e9, 1),
    }
    print(markdown(rows, meta))
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
