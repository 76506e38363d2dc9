"""Timers around the pieces of a decode step, for bench/step/breakdown.py: wrappers installed
in the bench's own process only (no project code changes), each forcing its lazy MLX result
with mx.eval so that its time is its own."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable


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


def install_timers(timers: Timers, runner, mx) -> TimedModel:
    """Wrap the pieces of mlxgw's step (once per process); everything else runs as shipped.
    Returns the timed model of mlxgw's runner."""
    from ...shared import protocol as p
    from ...worker.model.runners import sampling
    from ...worker.model.runners.batch_sampler import VectorGenerationBatch
    from ...worker.text import output_parser, textstream

    timed_model = TimedModel(runner.generator.model, timers, mx)
    # The decode batch holds its own reference, taken when the generator was built.
    runner.generator.model = runner.generator.decode_batch.model = timed_model

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
    return timed_model
