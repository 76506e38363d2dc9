"""The worker's boundary checks: every value that reaches native code is checked against the
model here, before a sequence is admitted.

MLX does not bounds-check gathers and scatters: a logit_bias id past the vocabulary writes
outside the logits (a crash, or silent corruption), and mlx-lm raises from inside the batch
step for a top_k it does not accept. The gateway range-checks what it can without knowing
the model; this module knows the model (its vocabulary size) and is the last line.

Choices (see README, "Reliability"):
- top_k >= the vocabulary keeps every token, so it is the same as no top-k: it is clamped
  to 0 (off), not refused;
- a seed may be any integer (OpenAI's API accepts negatives): it is mapped into the RNG's
  64-bit range (seed mod 2^64), so equal seeds still give equal tokens;
- logit_bias holds at most MAX_LOGIT_BIAS entries, each id in [0, vocabulary);
- n (choices), top_logprobs and prompt logprobs are refused by engines that cannot give them
  (`check_choices`, before a request with choices is split into its sequences)."""

from __future__ import annotations

import dataclasses
import math

from ...shared.errors import invalid
from ...shared.protocol import GenerateRequest, SamplingParams
from .choices import MAX_CHOICES

MAX_LOGIT_BIAS = 1024  # entries; OpenAI documents 300, clients send a handful
SEED_RANGE = 1 << 64  # mx.random.key takes an unsigned 64-bit seed


def _finite(value: float, name: str, lo: float, hi: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise invalid(f"'{name}' must be a finite number", name)
    if not lo <= value <= hi:
        raise invalid(f"'{name}' must be between {lo:g} and {hi:g}", name)
    return float(value)


def _integer(value: int, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(f"'{name}' must be an integer", name)
    return value


def check_logit_bias(bias: dict | None, vocab_size: int | None) -> dict[int, float] | None:
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise invalid("'logit_bias' must map token ids to numbers", "logit_bias")
    limit = min(MAX_LOGIT_BIAS, vocab_size) if vocab_size else MAX_LOGIT_BIAS
    if len(bias) > limit:
        raise invalid(f"'logit_bias' may hold at most {limit} entries ({len(bias)} given)", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = _integer(key, "logit_bias")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
            raise invalid(f"'logit_bias' token ids must be in {bound}; got {token}", "logit_bias")
        out[token] = _finite(value, "logit_bias", -100, 100)
    return out


def check_sampling(s: SamplingParams, vocab_size: int | None) -> SamplingParams:
    """A copy of the sampling parameters that is safe to build samplers from, or a 400."""
    top_k = _integer(s.top_k, "top_k")
    if top_k < 0:
        raise invalid("'top_k' must be 0 (off) or positive", "top_k")
    if vocab_size is not None and top_k >= vocab_size:
        top_k = 0  # keeps every token anyway
    seed = None if s.seed is None else _integer(s.seed, "seed") % SEED_RANGE
    penalty = s.repetition_penalty
    return dataclasses.replace(
        s,
        temperature=_finite(s.temperature, "temperature", 0, 100),
        top_p=_finite(s.top_p, "top_p", 0, 1),
        min_p=_finite(s.min_p, "min_p", 0, 1),
        top_k=top_k,
        seed=seed,
        repetition_penalty=None if penalty is None else _finite(penalty, "repetition_penalty", 1e-3, 100),
        presence_penalty=_finite(s.presence_penalty, "presence_penalty", -100, 100),
        frequency_penalty=_finite(s.frequency_penalty, "frequency_penalty", -100, 100),
        logit_bias=check_logit_bias(s.logit_bias, vocab_size),
    )


def check_prompt_tokens(tokens: list | None, vocab_size: int | None) -> None:
    if tokens is None:
        return
    bad = any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in tokens)
    if bad or (vocab_size is not None and any(t >= vocab_size for t in tokens)):
        bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, ...)"
        raise invalid(f"prompt token ids must be integers in {bound}", "prompt")


def check_generate(req: GenerateRequest, vocab_size: int | None) -> GenerateRequest:
    """The request with its sampling made safe for this model, or a 400 naming the field."""
    check_prompt_tokens(req.prompt_tokens, vocab_size)
    if req.max_tokens is not None and _integer(req.max_tokens, "max_tokens") < 1:
        raise invalid("'max_tokens' must be at least 1", "max_tokens")
    if req.reasoning_budget is not None and _integer(req.reasoning_budget, "reasoning_budget") < 0:
        raise invalid("'reasoning_budget' must not be negative", "reasoning_budget")
    _integer(req.priority, "priority")
    _integer(req.stream_interval, "stream_interval")
    if req.timeout_s is not None:
        _finite(req.timeout_s, "timeout", 0, 1e9)
    if req.cache_retention_s is not None:  # a caching hint: at most OpenAI's longest (24 h)
        _finite(req.cache_retention_s, "cache_retention", 0, 86400)
    if not isinstance(req.stop, list) or any(not isinstance(s, str) for s in req.stop):
        raise invalid("'stop' must be a list of strings", "stop")
    return dataclasses.replace(req, sampling=check_sampling(req.sampling, vocab_size))


def check_choices(req: GenerateRequest, supports_choices: bool, supports_prompt_logprobs: bool) -> None:
    """n, top_logprobs and prompt logprobs: in range, and only where the engine gives them."""
    if not isinstance(req.n, int) or not 1 <= req.n <= MAX_CHOICES:
        raise invalid(f"'n' must be between 1 and {MAX_CHOICES}", "n")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise invalid("'top_logprobs' must be between 0 and 20", "top_logprobs")
    if (req.n > 1 or req.logprobs is not None) and not supports_choices:
        param = "n" if req.n > 1 else "logprobs"
        raise invalid(f"this model's engine does not support '{param}'", param)
    if req.prompt_logprobs is not None:
        if not isinstance(req.prompt_logprobs, int) or not 0 <= req.prompt_logprobs <= 20:
            raise invalid("'logprobs' must be between 0 and 20", "logprobs")
        if not supports_prompt_logprobs:
            raise invalid("this model's engine does not support prompt logprobs (echo with logprobs)", "echo")
