"""Per-request samplers and logits processors, built from mlx-lm's own pieces.

Each row of the batch carries a RowSampling (its sampler) and, when it has penalties or a
logit bias, a RowPenalties (its first logits processor). Both are callables that do this
row's work alone, the reference mlx-lm's per-row batch step calls, and both expose their
parameters so that worker/model/runners/batch_sampler.py can do the whole batch's work in one operation
per step instead (the same values, masks and seeded draws)."""

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

from ....shared.protocol import SamplingParams
from .isolation import SequenceGuard

Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]

# Penalties look back this many tokens (OpenAI's are over the whole completion; mlx-lm's
# processors need a window, and a long one costs a gather per step).
PENALTY_CONTEXT = 256
# mlx-lm's default window for the repetition penalty (build_logits_processors keeps it).
REPETITION_CONTEXT = 20


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


class RowSampling:
    """One request's sampler. Called on its own logprobs row, it samples as mlx-lm's
    make_sampler does (greedy at temperature 0); with a seed it draws from its own key,
    split once per step, so the same seed gives the same tokens in any batch. The batched
    sampler reads params and advances `key` the same way for the whole batch."""

    def __init__(self, p: SamplingParams, guard: SequenceGuard | None = None):
        self.params = p
        self.guard = guard
        self.greedy = p.temperature <= 0
        self.seeded = not self.greedy and p.seed is not None
        self.key = mx.random.key(p.seed) if self.seeded else None
        # Whether the batched step must hand this row exact log-probabilities: a row that
        # reports them (the runner sets it), or a seeded one (its draws must be bit-identical
        # in any batch). Other rows sample from the raw logits, the same distribution.
        self.wants_logprobs = False
        self._filters = _filters(p)
        sampler = make_sampler(temp=max(p.temperature, 0.0), top_p=p.top_p, min_p=p.min_p, top_k=p.top_k)
        self._unseeded = None if self.seeded else sampler

    @property
    def exact(self) -> bool:
        return self.seeded or self.wants_logprobs

    def next_key(self) -> mx.array:
        """The subkey of this step's draw; the row's key moves on."""
        self.key, sub = mx.random.split(self.key)
        return sub

    def draw(self, logprobs: mx.array) -> mx.array:
        if not self.seeded:
            return self._unseeded(logprobs)
        for f in self._filters:
            logprobs = f(logprobs)
        return mx.random.categorical(logprobs * (1 / self.params.temperature), key=self.next_key())

    def __call__(self, logprobs: mx.array) -> mx.array:
        guard = self.guard
        if guard is None:
            return self.draw(logprobs)
        if not guard.faulted:  # after a fault it draws greedily (the token is dropped)
            try:
                return self.draw(logprobs)
            except Exception as e:
                guard.record(e, "sampling")
        return mx.argmax(logprobs, axis=-1)


class RowPenalties:
    """One request's logit bias and repetition/presence/frequency penalties (in mlx-lm's
    order), as a logits processor for its row; the batched step applies many rows' at once."""

    def __init__(self, p: SamplingParams, guard: SequenceGuard | None = None):
        self.bias = {int(k): float(v) for k, v in p.logit_bias.items()} if p.logit_bias else {}
        self.repetition = p.repetition_penalty if p.repetition_penalty not in (None, 1.0) else None
        self.presence = p.presence_penalty or None
        self.frequency = p.frequency_penalty or None
        self.guard = guard
        self._reference = make_logits_processors(
            logit_bias=self.bias or None,
            repetition_penalty=self.repetition,
            presence_penalty=self.presence,
            presence_context_size=PENALTY_CONTEXT,
            frequency_penalty=self.frequency,
            frequency_context_size=PENALTY_CONTEXT,
        )

    def __bool__(self) -> bool:
        return bool(self._reference)

    def apply(self, tokens: mx.array, logits: mx.array) -> mx.array:
        for f in self._reference:
            logits = f(tokens, logits)
        return logits

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        guard = self.guard
        if guard is None:
            return self.apply(tokens, logits)
        if guard.faulted:  # after a fault the logits pass unchanged
            return logits
        try:
            return self.apply(tokens, logits)
        except Exception as e:  # this sequence's fault; the scheduler ends it after the step
            guard.record(e, "biasing or penalising its logits")
            return logits


def build_sampler(p: SamplingParams, wants_logprobs: bool = False) -> Sampler:
    sampler = RowSampling(p)
    sampler.wants_logprobs = wants_logprobs
    return sampler


def build_logits_processors(p: SamplingParams) -> list:
    penalties = RowPenalties(p)
    return [penalties] if penalties else []


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
    if isinstance(fn, RowSampling) and fn.guard is None:
        fn.guard = guard  # stays a RowSampling, which the batched step recognises
        return fn

    def guarded(logprobs: mx.array) -> mx.array:
        if not guard.faulted:
            try:
                return fn(logprobs)
            except Exception as e:
                guard.record(e, "sampling")
        return mx.argmax(logprobs, axis=-1)

    return guarded


def guarded_processors(sampling: SamplingParams, constraint, guard: SequenceGuard | None) -> list[Processor]:
    """The sequence's logits processors: bias and penalties (one RowPenalties, which guards
    itself), then any constraint (masks apply last; several may be chained), each wrapped in
    the sequence's guard."""
    penalties = RowPenalties(sampling, guard)
    constraints = [] if constraint is None else constraint if isinstance(constraint, list) else [constraint]
    if guard is not None:
        constraints = [guard_processor(f, guard) for f in constraints]
    return ([penalties] if penalties else []) + constraints
