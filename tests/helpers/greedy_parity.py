"""Greedy parity with mlx-lm: its own tokens for a prompt, and a comparison that forgives
only exact ties (two top logits equal), as tests/e2e/test_families.py judges the matrix."""

from __future__ import annotations


def mlx_lm_greedy(model, prompt: list[int], max_tokens: int, logit_bias: dict[int, float] | None = None) -> list[int]:
    """mlx-lm alone (generate_step, greedy, with mlx-lm's own attention: the worker routes
    its model modules through worker/model/cpu/cpu_attention.py, process-wide)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    from mlxgw.worker.model.cpu.cpu_attention import bypassed

    processors = make_logits_processors(logit_bias=logit_bias) if logit_bias else None
    with bypassed():
        steps = generate_step(
            mx.array(prompt), model, max_tokens=max_tokens, sampler=make_sampler(0.0), logits_processors=processors
        )
        return [int(token) for token, _ in steps]


def is_tie(model, context: list[int], a: int, b: int) -> bool:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxgw.worker.model.cpu.cpu_attention import bypassed

    with bypassed():
        logits = model(mx.array([context]), cache=make_prompt_cache(model))[0, -1].astype(mx.float32)
    return float(logits[a]) == float(logits[b])


def assert_greedy_equal(model, prompt: list[int], reference: list[int], got: list[int], what: str) -> None:
    """got equals the reference, or differs first where the reference had an exact tie."""
    for i, (r, g) in enumerate(zip(reference, got)):
        if r != g:
            assert is_tie(model, prompt + reference[:i], r, g), f"{what}: token {i} is {g}, mlx-lm gives {r}"
            return
    assert len(got) == len(reference), f"{what}: {len(got)} tokens, mlx-lm gives {len(reference)}"
