"""Per-request samplers and logits processors, built from mlx-lm's own pieces."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)
from mlxgw.shared.protocol import SamplingParams

from .isolation import SequenceGuard

Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]

# Penalties look back this many tokens (OpenAI's are over the whole completion; mlx-lm's
# processors need a window, and a long one costs a gather per step).
PENALTY_CONTEXT = 256


def _filters(p: SamplingParams) -> list[Callable[[mx.array], mx.array]]:
    """top-p, min-p and top-k, as mlx-lm applies them to log-probabilities."""
    filters = []
    if 0 < p.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, p.top_p))
    if p.min_p:
        filters.append(lambda x: apply_min_p(x, p.min_p, 1))
    if p.top_k > 0:
        filters.append(lambda x: apply_top_k(x, p.top_k))
    return filters


def _seeded_sampler(p: SamplingParams) -> Sampler:
    """mlx-lm's samplers draw from MLX's global generator, so a per-request seed needs its
    own key: split once per step, so the same seed gives the same tokens even in a batch."""
    filters = _filters(p)
    state = {"key": mx.random.key(p.seed)}

    def sampler(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        state["key"], sub = mx.random.split(state["key"])
        return mx.random.categorical(logprobs * (1 / p.temperature), key=sub)

    return sampler


def build_sampler(p: SamplingParams) -> Sampler:
    if p.temperature <= 0 or p.seed is None:
        return make_sampler(temp=max(p.temperature, 0.0), top_p=p.top_p, min_p=p.min_p, top_k=p.top_k)
    return _seeded_sampler(p)


def build_logits_processors(p: SamplingParams) -> list:
    return make_logits_processors(
        logit_bias={int(k): float(v) for k, v in p.logit_bias.items()} if p.logit_bias else None,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty not in (None, 1.0) else None,
        presence_penalty=p.presence_penalty or None,
        presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=p.frequency_penalty or None,
        frequency_context_size=PENALTY_CONTEXT,
    )


def sampling_processor(p: SamplingParams) -> Callable[[mx.array, mx.array], mx.array]:
    """Temperature and top-p/top-k/min-p as a logits processor, for generators that share one
    sampler across the batch (mlx-vlm's): the shared sampler then draws from these logits at
    temperature 1, which is this request's own distribution. Temperature 0 keeps the argmax;
    a seeded request draws here, with its own key, and leaves the sampler no choice."""
    filters = _filters(p)
    state = {"key": mx.random.key(p.seed)} if p.seed is not None else None

    def only(token: mx.array, logits: mx.array) -> mx.array:
        return mx.where(mx.arange(logits.shape[-1]) == token, 0.0, -mx.inf)

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        if p.temperature <= 0:
            return only(mx.argmax(logits, axis=-1, keepdims=True), logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        for f in filters:
            logprobs = f(logprobs)
        scaled = logprobs * (1 / p.temperature)
        if state is None:
            return scaled
        state["key"], sub = mx.random.split(state["key"])
        return only(mx.random.categorical(scaled, key=sub)[..., None], logits)

    return processor


def guard_processor(fn: Processor, guard: SequenceGuard) -> Processor:
    """fn, made harmless to the batch: after a fault it returns the logits unchanged."""

    def guarded(tokens: mx.array, logits: mx.array) -> mx.array:
        if guard.faulted:
            return logits
        try:
            return fn(tokens, logits)
        except Exception as e:  # this sequence's fault; the scheduler ends it after the step
            guard.record(e, "constraining or biasing its logits")
            return logits

    return guarded


def guard_sampler(fn: Sampler, guard: SequenceGuard) -> Sampler:
    """fn, made harmless to the batch: after a fault it draws greedily (the token is dropped)."""

    def guarded(logprobs: mx.array) -> mx.array:
        if not guard.faulted:
            try:
                return fn(logprobs)
            except Exception as e:
                guard.record(e, "sampling")
        return mx.argmax(logprobs, axis=-1)

    return guarded


def guarded_processors(sampling: SamplingParams, constraint, guard: SequenceGuard | None) -> list[Processor]:
    """The sequence's logits processors: bias and penalties, then any constraint (masks apply
    last; several may be chained), each wrapped in the sequence's guard."""
    processors = build_logits_processors(sampling)
    if constraint is not None:
        processors += constraint if isinstance(constraint, list) else [constraint]
    return [guard_processor(f, guard) for f in processors] if guard is not None else processors
