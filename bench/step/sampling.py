"""The sampler alone, mlx-lm's per-row step against the batch-wide one (worker/model/runners/batch_sampler.py),
on random logits of a model's width: `python -m mlxgw.bench.step.breakdown --sampling-only N`.
Much less noisy than whole steps on a loaded machine (no model is run)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from ..stats import median


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _sampling_case(batch: int, vocab: int, penalty: float) -> dict[str, Callable]:
    """One step's processors + normalize + sampling on random logits, both ways: mlx-lm's
    step (processors row by row, one logsumexp, one sampler call per row) and the batched."""
    import mlx.core as mx

    from ...shared.protocol import SamplingParams
    from ...worker.model.runners.batch_sampler import PenaltyPlan, SamplePlan, apply_penalties, sample_rows
    from ...worker.model.runners.sampling import RowPenalties, RowSampling

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
        row = {"batch": batch, **{k: _ms(median(v)) for k, v in times.items()}}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out
