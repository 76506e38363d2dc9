"""Driving a runner in-process: run jobs together in one batch to their ends."""

from __future__ import annotations

from mlxgw.shared.protocol import SamplingParams
from mlxgw.worker.model.interfaces import Row

GREEDY = SamplingParams(temperature=0.0)


def generate_together(runner, jobs: list[tuple]) -> list[list[int]]:
    """Insert every job (prompt, max_tokens[, sampling]; greedy by default) into the runner's
    batch and step until all end; each job's tokens, in job order."""
    slot = {}
    for i, (prompt, max_tokens, *sampling) in enumerate(jobs):
        uid, _ = runner.insert(Row(prompt, max_tokens, sampling[0] if sampling else GREEDY))
        slot[uid] = i
    out: list[list[int]] = [[] for _ in jobs]
    finished = 0
    while finished < len(jobs):
        for t in runner.step().tokens:
            out[slot[t.uid]].append(t.token)
            finished += t.finish is not None
    return out


def run_alone(runner, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """One greedy request stepped to its end (other rows in the batch step along): its tokens
    and how many prompt tokens it found in the prefix cache."""
    uid, cached = runner.insert(Row(prompt, max_tokens, GREEDY))
    out: list[int] = []
    while True:
        for t in runner.step().tokens:
            if t.uid == uid:
                out.append(t.token)
                if t.finish is not None:
                    return out, cached


def speculative_runner(model_dir, speculative):
    """An in-process MLXRunner without a prefix cache, speculating as configured."""
    from mlxgw.worker.process.build_mlx import build_mlx_runner

    return build_mlx_runner(
        model_dir, context_length=None, max_num_seqs=8, prefill_step_size=256, cache_bytes=0, speculative=speculative
    )
