"""Attention for MLX's CPU backend: the softmax in base 2, and long rows split over two cores.

On the CPU backend `mx.fast.scaled_dot_product_attention` falls back to plain ops: a
broadcast matmul for the scores, a softmax, a matmul for the output, all on the one thread of
the model's stream (only a large enough GEMM reaches the BLAS's second thread). Measured on
the 2-core development machine (SmolLM2-135M's heads: 9 query, 3 KV, 64 wide; one layer,
float32; bench/HISTORY.md at 3b9d616, "The forward itself on the CPU"):
- `exp` costs 28 ns an element there, against 11 for `power(2, x)` and 2.4 for a multiply,
  so the softmax alone was 2.0 of 8.8 ms at batch 16 over 500 positions;
- the fallback broadcasts the KV heads against the query heads' groups, where folding the
  group into the query rows needs no broadcast;
- everything but a large GEMM ran on one core while the other waited.

So here the scores are scaled by log2(e) with the query (one multiply of the small side), the
softmax is `power(2, s - max)`, and rows with many scores are cut in two along the keys, each
half on its own stream (MLX gives every CPU stream its own thread), the halves joined with
their maxima and sums as flash-decoding does. Results agree with the fallback to float32
rounding (tests/unit/test_cpu_attention.py, the family matrix's greedy parity).

Installed by the MLX runner on the CPU device only, into mlx-lm's model modules (each calls
`scaled_dot_product_attention` from `mlx_lm.models.base` by name). What it does not handle it
hands to mlx-lm's own function unchanged: quantized KV, attention sinks, other dtypes than
float32, any device but the CPU. MLXGW_CPU_ATTENTION=0 turns it off."""

from __future__ import annotations

import math
import os
import sys
from contextlib import contextmanager

import mlx.core as mx

from ....shared.platform import on_cpu_device

LOG2E = 1.0 / math.log(2.0)
# Scores (rows x keys, over the batch and heads) from which two streams pay for their join:
# at batch 16 x 9 heads, 100 keys (14k) one stream was faster (0.95 against 1.9 ms), 500 keys
# (72k) two were (2.9 against 4.0 ms).
SPLIT_MIN_SCORES = 65_536
SPLIT_MIN_KEYS = 256
# A decode step's attention costs ~3x more per KV byte read than its matmuls per weight byte
# here: Qwen2.5-Coder-0.5B in float32 stepped one row in 0.21-0.25 s and paid 7.6 us per row
# and token attended, a forward's fixed cost of ~30,000 tokens, where the bytes alone (2.5 GB
# of weights, 24 KiB of KV a token) say 102,566. For the second decode batch's rule
# (worker/process/build_mlx.py); a GPU reads both at its memory's speed.
KV_BYTE_COST = 3

_original = None  # mlx-lm's scaled_dot_product_attention, for what this does not handle


class _Settings:
    enabled = True  # False: every call goes to mlx-lm's function (bypassed(), for comparisons)
    # two streams need two cores; the runner sets it per step, False while the BLAS policy
    # runs one thread (a busy host, where a second thread waits to be scheduled)
    parallel = (os.cpu_count() or 1) > 1
    second_stream = None  # created on first use, on the CPU device


settings = _Settings()


def _partial(q, k, v, mask, stream):
    """Scores in base 2 of one slice of the keys: its max, its sum of powers, and its
    unnormalised output."""
    s = mx.matmul(q, mx.swapaxes(k, -1, -2, stream=stream), stream=stream)
    if mask is not None:
        if mask.dtype == mx.bool_:
            s = mx.where(mask, s, mx.array(-mx.inf, s.dtype), stream=stream)
        else:  # additive, in natural-log units
            s = mx.add(s, mx.multiply(mask, LOG2E, stream=stream), stream=stream)
    peak = mx.max(s, axis=-1, keepdims=True, stream=stream)
    # a slice whose every key is masked for a row has peak -inf: its powers must be 0, not nan
    # (the join then weighs it 2^-inf = 0); the peak returned stays -inf
    shift = (
        mx.where(mx.isinf(peak, stream=stream), mx.array(0.0, s.dtype), peak, stream=stream)
        if mask is not None
        else peak
    )
    p = mx.power(mx.array(2.0, s.dtype), mx.subtract(s, shift, stream=stream), stream=stream)
    total = mx.sum(p, axis=-1, keepdims=True, stream=stream)
    return peak, total, mx.matmul(p, v, stream=stream)


def _causal(L: int, T: int) -> mx.array:
    """Query row i (the last L of T positions) sees keys 0 .. T - L + i."""
    return mx.arange(T)[None, :] <= (mx.arange(L) + (T - L))[:, None]


def _fold_mask(mask, L: int, T: int, rep: int):
    """A mask for scores laid out as (B, KV heads, rep * L, T); NotImplemented where only
    mlx-lm's function knows what to do with it."""
    if isinstance(mask, str):
        if mask != "causal":  # a kind of mask this does not know: mlx-lm's function decides
            return NotImplemented
        if L == 1:
            return None
        mask = _causal(L, T)
    if mask is None:
        return None
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] != 1:  # a per-head mask: not folded here
        return NotImplemented
    if rep > 1 and mask.shape[2] > 1:
        mask = mx.tile(mask, (1, 1, rep, 1))
    return mask


def attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's scaled_dot_product_attention, with the CPU path above where it applies."""
    if (
        not settings.enabled
        or sinks is not None
        or hasattr(cache, "bits")
        or queries.dtype != mx.float32
        or keys.dtype != mx.float32
        or not on_cpu_device()
    ):
        return _original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    B, Hq, L, D = queries.shape
    Hk, T = keys.shape[1], keys.shape[2]
    if Hq % Hk:
        return _original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    rep = Hq // Hk
    folded = _fold_mask(mask, L, T, rep)
    if folded is NotImplemented:
        return _original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    # (B, Hq, L, D) -> (B, Hk, rep * L, D): each KV head's query group as rows of one matmul
    q = (queries * (scale * LOG2E)).reshape(B, Hk, rep * L, D)
    if settings.parallel and T >= SPLIT_MIN_KEYS and B * Hq * L * T >= SPLIT_MIN_SCORES:
        out = _two_halves(q, keys, values, folded, T)
    else:
        _, total, out = _partial(q, keys, values, folded, None)
        out = out / total
    return out.reshape(B, Hq, L, values.shape[-1])


def _two_halves(q, keys, values, mask, T: int):
    if settings.second_stream is None:
        settings.second_stream = mx.new_stream(mx.cpu)
    h = T // 2
    first, second = (None, None) if mask is None else (mask[..., :h], mask[..., h:])
    p0, t0, o0 = _partial(q, keys[..., :h, :], values[..., :h, :], first, None)
    p1, t1, o1 = _partial(q, keys[..., h:, :], values[..., h:, :], second, settings.second_stream)
    peak = mx.maximum(p0, p1)
    w0, w1 = mx.power(2.0, p0 - peak), mx.power(2.0, p1 - peak)
    return (o0 * w0 + o1 * w1) / (t0 * w0 + t1 * w1)


def install() -> bool:
    """Route mlx-lm's model modules (those imported so far) through `attention`; whether on."""
    global _original
    if os.environ.get("MLXGW_CPU_ATTENTION", "1") == "0" or not on_cpu_device():
        return False
    from mlx_lm.models import base

    if _original is None:
        _original = base.scaled_dot_product_attention
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is _original:
            module.scaled_dot_product_attention = attention
    return True


@contextmanager
def bypassed():
    """mlx-lm's own attention inside the block (a reference computed beside the engine, the
    in-process benches' mlx_lm.server loop)."""
    before, settings.enabled = settings.enabled, False
    try:
        yield
    finally:
        settings.enabled = before
