"""A small MLX Whisper: encoder, and a decoder whose KV cache batches rows of different lengths.

Parameter names follow mlx-whisper's layout (so an imported folder also loads there), but the
decoder is our own: each row of a batch carries its own position, so windows that started
decoding at different engine steps share one forward pass per step (continuous batching).
Written here rather than taken from mlx-audio or mlx-whisper because both decode one batch
in lockstep from a shared start, and mlx-audio's module pulls huggingface_hub and tqdm."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx import nn

from ....shared.platform import on_cpu_device

try:  # numpy has no erf; scipy (installed with mlx-audio) has a vectorised one
    from scipy.special import erf
except ImportError:  # then the encoder's GELU stays in MLX
    erf = None


@dataclass
class WhisperDims:
    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int


def sinusoids(length: int, channels: int, max_timescale: float = 10000) -> mx.array:
    log_timescale_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = mx.exp(-log_timescale_increment * mx.arange(channels // 2))
    scaled_time = mx.arange(length)[:, None] * inv_timescales[None, :]
    return mx.concatenate([mx.sin(scaled_time), mx.cos(scaled_time)], axis=1)


class MultiHeadAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)

    def split_heads(self, x: mx.array) -> mx.array:
        """(batch, T, state) -> (batch, heads, T, head_dim), contiguous: attention over a
        strided view copies it on every call, which dominated the decoder's steps."""
        b, t, d = x.shape
        return mx.contiguous(x.reshape(b, t, self.n_head, d // self.n_head).transpose(0, 2, 1, 3))

    def merge_heads(self, o: mx.array) -> mx.array:
        b, h, t, hd = o.shape
        return self.out(o.transpose(0, 2, 1, 3).reshape(b, t, h * hd))

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> mx.array:
        d = q.shape[-1]
        o = mx.fast.scaled_dot_product_attention(
            self.split_heads(q), self.split_heads(k), self.split_heads(v), scale=(d // self.n_head) ** -0.5, mask=mask
        )
        return self.merge_heads(o)

    def attend_long(self, x: mx.array) -> mx.array:
        """Self-attention over the encoder's 1500 positions. On the CPU the softmax of the
        (heads, 1500, 1500) scores is most of the encoder's time in MLX (a scalar exp, one
        thread); numpy's vectorised exp, split over the cores, is several times faster, so
        the scores take a trip through numpy there. Elsewhere (Metal) MLX's fused attention."""
        q, k, v = (self.split_heads(p(x)) for p in (self.query, self.key, self.value))
        scale = (q.shape[-1]) ** -0.5
        if not on_cpu_device():
            return self.merge_heads(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale))
        out = []
        for i in range(q.shape[0]):  # one window's scores (54 MB for tiny) stay in cache; 8 did not
            scores = (q[i] * scale) @ k[i].swapaxes(-1, -2)
            out.append(in_numpy(scores, _softmax_rows).astype(v.dtype) @ v[i])
        return self.merge_heads(mx.stack(out))


_POOL = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="whisper-cpu")
_SQRT_HALF = np.float32(math.sqrt(0.5))


def _softmax_rows(part: np.ndarray) -> None:
    part -= part.max(axis=-1, keepdims=True)
    np.exp(part, out=part)
    part /= part.sum(axis=-1, keepdims=True)


def _gelu_rows(part: np.ndarray) -> None:
    """Exact (erf) GELU, as nn.gelu computes it."""
    y = erf(part * _SQRT_HALF)
    y += 1
    y *= 0.5
    part *= y


def in_numpy(a: mx.array, rows_fn) -> mx.array:
    """Apply rows_fn in place to a float32 array's buffer, its rows split over threads (numpy
    and scipy release the GIL in their ufuncs). For the elementwise work MLX's CPU backend
    runs slowly (scalar exp and erf on one thread): numpy's vectorised kernels are faster.
    `a` must be a fresh, contiguous result nothing else holds."""
    a = a.astype(mx.float32)
    mx.eval(a)
    view = np.array(a, copy=False)  # writable, zero-copy
    if not view.flags.c_contiguous:  # a strided result: work on a copy (a reshape would copy silently)
        view = np.ascontiguousarray(view)
        a = None
    flat = view.reshape(-1, view.shape[-1])
    parts = [p for p in np.array_split(flat, _POOL._max_workers) if p.size]
    list(_POOL.map(rows_fn, parts))
    return mx.array(view) if a is None else a


class ResidualAttentionBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int, cross_attention: bool = False):
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head)
        self.attn_ln = nn.LayerNorm(n_state)
        self.cross_attn = MultiHeadAttention(n_state, n_head) if cross_attention else None
        self.cross_attn_ln = nn.LayerNorm(n_state) if cross_attention else None
        self.mlp1 = nn.Linear(n_state, 4 * n_state)
        self.mlp2 = nn.Linear(4 * n_state, n_state)
        self.mlp_ln = nn.LayerNorm(n_state)

    def mlp(self, x: mx.array) -> mx.array:
        return self.mlp2(nn.gelu(self.mlp1(self.mlp_ln(x))))

    def mlp_long(self, x: mx.array) -> mx.array:
        """The encoder's MLP (1500 positions x 1536): on the CPU its GELU runs in numpy."""
        if not on_cpu_device() or erf is None:
            return self.mlp(x)
        h = self.mlp1(self.mlp_ln(x))
        return self.mlp2(in_numpy(h, _gelu_rows).astype(x.dtype))


class AudioEncoder(nn.Module):
    def __init__(self, dims: WhisperDims):
        super().__init__()
        n = dims.n_audio_state
        self.conv1 = nn.Conv1d(dims.n_mels, n, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(n, n, kernel_size=3, stride=2, padding=1)
        self._positional_embedding = sinusoids(dims.n_audio_ctx, n)
        self.blocks = [ResidualAttentionBlock(n, dims.n_audio_head) for _ in range(dims.n_audio_layer)]
        self.ln_post = nn.LayerNorm(n)

    def __call__(self, mel: mx.array) -> mx.array:
        """mel: (batch, frames, n_mels) -> features (batch, n_audio_ctx, n_audio_state)."""
        x = nn.gelu(self.conv1(mel))
        x = nn.gelu(self.conv2(x))
        x = x + self._positional_embedding[: x.shape[1]].astype(x.dtype)
        for block in self.blocks:
            x = x + block.attn.attend_long(block.attn_ln(x))
            x = x + block.mlp_long(x)
        return self.ln_post(x)


@dataclass
class DecoderCache:
    """Per layer, in head layout (batch, heads, positions, head_dim): self-attention keys and
    values (positions = capacity, filled up to each row's position), and the cross-attention
    keys (transposed: (batch, heads, head_dim, audio positions)) and values of each row's
    audio, projected once at prefill rather than at every step."""

    self_k: list[mx.array]
    self_v: list[mx.array]
    cross_k: list[mx.array]
    cross_v: list[mx.array]
    positions: list[int]  # per row: tokens in the cache = where the next one goes

    @property
    def size(self) -> int:
        return len(self.positions)


class TextDecoder(nn.Module):
    def __init__(self, dims: WhisperDims):
        super().__init__()
        n = dims.n_text_state
        self.n_ctx = dims.n_text_ctx
        self.token_embedding = nn.Embedding(dims.n_vocab, n)
        self.positional_embedding = mx.zeros((dims.n_text_ctx, n))
        self.blocks = [
            ResidualAttentionBlock(n, dims.n_text_head, cross_attention=True) for _ in range(dims.n_text_layer)
        ]
        self.ln = nn.LayerNorm(n)

    def _logits(self, x: mx.array) -> mx.array:
        return self.token_embedding.as_linear(self.ln(x)).astype(mx.float32)

    def prefill(self, prompts: list[list[int]], features: mx.array) -> tuple[mx.array, DecoderCache]:
        """Run prompts of equal length (batch, T) over their audio features (batch, ctx, state):
        the logits of every prompt position (batch, T, vocab) and the rows' cache."""
        t = len(prompts[0])
        x = self.token_embedding(mx.array(prompts)) + self.positional_embedding[:t]
        mask = nn.MultiHeadAttention.create_additive_causal_mask(t).astype(x.dtype)
        cache = DecoderCache([], [], [], [], [t] * len(prompts))
        for block in self.blocks:
            y = block.attn_ln(x)
            sa, ca = block.attn, block.cross_attn
            k, v = sa.split_heads(sa.key(y)), sa.split_heads(sa.value(y))
            x = x + sa.merge_heads(_attend_short(sa.split_heads(sa.query(y)), k.swapaxes(-1, -2), v, mask))
            ck, cv = ca.split_heads(ca.key(features)), ca.split_heads(ca.value(features))
            ck = mx.contiguous(ck.swapaxes(-1, -2))
            x = x + ca.merge_heads(_attend_short(ca.split_heads(ca.query(block.cross_attn_ln(x))), ck, cv))
            x = x + block.mlp(x)
            cache.self_k.append(k)
            cache.self_v.append(v)
            cache.cross_k.append(ck)
            cache.cross_v.append(cv)
        return self._logits(x), cache

    def cross_attention_scores(self, tokens: list[int], features: mx.array, heads: list[tuple[int, int]]) -> mx.array:
        """Pre-softmax cross-attention scores (heads, T, ctx) of the given (layer, head)
        pairs for one row (Whisper's alignment heads, for word timestamps)."""
        t = len(tokens)
        x = self.token_embedding(mx.array([tokens])) + self.positional_embedding[:t]
        mask = nn.MultiHeadAttention.create_additive_causal_mask(t).astype(x.dtype)
        wanted: dict[int, list[int]] = {}
        for layer, head in heads:
            wanted.setdefault(layer, []).append(head)
        scores = []
        for i, block in enumerate(self.blocks):
            if i > max(wanted):
                break
            y = block.attn_ln(x)
            x = x + block.attn.attend(block.attn.query(y), block.attn.key(y), block.attn.value(y), mask)
            ca = block.cross_attn
            q, k = ca.query(block.cross_attn_ln(x)), ca.key(features)
            if i in wanted:
                h, d = ca.n_head, q.shape[-1] // ca.n_head
                qh = q.reshape(t, h, d).transpose(1, 0, 2)
                kh = k.reshape(-1, h, d).transpose(1, 2, 0)
                s = (qh @ kh) * d**-0.5
                scores.extend(s[j] for j in wanted[i])
            x = x + ca.attend(q, k, ca.value(features), None)
            x = x + block.mlp(x)
        return mx.stack(scores).astype(mx.float32)

    def step(self, tokens: mx.array, cache: DecoderCache) -> mx.array:
        """One token per row at each row's own position: logits (batch, vocab). The cache
        grows in place (its capacity doubles when a row reaches it)."""
        b = cache.size
        pos = mx.array(cache.positions)
        longest = max(cache.positions) + 1
        _ensure_capacity(cache, longest)
        x = self.token_embedding(tokens[:, None]) + self.positional_embedding[pos][:, None]
        cols = mx.arange(longest)
        mask = mx.where(cols[None, :] <= pos[:, None], 0.0, -1e9).astype(x.dtype)[:, None, None, :]
        rows = mx.arange(b)
        for i, block in enumerate(self.blocks):
            y = block.attn_ln(x)
            sa, ca = block.attn, block.cross_attn
            cache.self_k[i][rows, :, pos] = sa.split_heads(sa.key(y))[:, :, 0]
            cache.self_v[i][rows, :, pos] = sa.split_heads(sa.value(y))[:, :, 0]
            k, v = cache.self_k[i][:, :, :longest], cache.self_v[i][:, :, :longest]
            x = x + sa.merge_heads(_attend_short(sa.split_heads(sa.query(y)), k.swapaxes(-1, -2), v, mask))
            q = ca.split_heads(ca.query(block.cross_attn_ln(x)))
            x = x + ca.merge_heads(_attend_short(q, cache.cross_k[i], cache.cross_v[i]))
            x = x + block.mlp(x)
        cache.positions = [p + 1 for p in cache.positions]
        return self._logits(x[:, 0])


def _attend_short(q: mx.array, k_t: mx.array, v: mx.array, mask: mx.array | None = None) -> mx.array:
    """Attention of a few query positions (batch, heads, T, head_dim) over keys given
    transposed (batch, heads, head_dim, S): two small matmuls, no copy of the keys."""
    scores = (q * q.shape[-1] ** -0.5) @ k_t
    if mask is not None:
        scores = scores + mask
    return mx.softmax(scores.astype(mx.float32), axis=-1).astype(v.dtype) @ v


def _ensure_capacity(cache: DecoderCache, needed: int) -> None:
    have = cache.self_k[0].shape[2]
    if needed <= have:
        return
    grow = max(needed, 2 * have) - have
    for kv in (cache.self_k, cache.self_v):
        for i, a in enumerate(kv):
            b, h, _, hd = a.shape
            kv[i] = mx.concatenate([a, mx.zeros((b, h, grow, hd), a.dtype)], axis=2)


def merge_caches(a: DecoderCache | None, b: DecoderCache) -> DecoderCache:
    """Rows of a, then rows of b (self caches padded to one capacity)."""
    if a is None:
        return b
    cap = max(a.self_k[0].shape[2], b.self_k[0].shape[2])
    _ensure_capacity(a, cap)
    _ensure_capacity(b, cap)

    def cat(x: list[mx.array], y: list[mx.array]) -> list[mx.array]:
        return [mx.concatenate([p, q], axis=0) for p, q in zip(x, y)]

    return DecoderCache(
        cat(a.self_k, b.self_k),
        cat(a.self_v, b.self_v),
        cat(a.cross_k, b.cross_k),
        cat(a.cross_v, b.cross_v),
        a.positions + b.positions,
    )


def keep_rows(cache: DecoderCache, rows: list[int]) -> DecoderCache | None:
    if not rows:
        return None
    idx = mx.array(rows)

    def take(x: list[mx.array]) -> list[mx.array]:
        return [a[idx] for a in x]

    return DecoderCache(
        take(cache.self_k),
        take(cache.self_v),
        take(cache.cross_k),
        take(cache.cross_v),
        [cache.positions[r] for r in rows],
    )


class Whisper(nn.Module):
    def __init__(self, dims: WhisperDims):
        super().__init__()
        self.dims = dims
        self.encoder = AudioEncoder(dims)
        self.decoder = TextDecoder(dims)
