"""Quantized KV under continuous batching (`kv_bits: 8|4` in models.yaml).

mlx-lm quantizes the KV cache of one sequence (QuantizedKVCache) but has no batch version,
so mlx_lm.server turns batching off when --kv-bits is set. BatchQuantizedKVCache is
mlx-lm's BatchKVCache (left-padded rows, one write index) with keys and values held as
mx.quantize triplets (packed uint32, scales, biases): every operation BatchKVCache does on
one array (grow, write, slice, roll, filter, pad, extract, merge) is done on each part of the
triplet. It has `bits` and `group_size`, so mlx-lm's attention takes its quantized path.
A row extracted from the batch is a MergeableQuantizedKVCache (a QuantizedKVCache that
merges back into a batch), which the prefix cache stores and trims like any KV layer.

Rows keep their positions exactly as in BatchKVCache, so continuous batching, the prefix
cache and speculation (whose rollback rolls each triplet part: worker/model/speculation/spec_verify.py) work
unchanged. Memory per token: bits/8 bytes per element plus a scale and a bias per group."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll


def _quantize(x: mx.array, group_size: int, bits: int) -> tuple:
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


def _zeros(shape: tuple, dim: int, dtype, group_size: int, bits: int) -> tuple:
    per_int = 32 // bits
    return (
        mx.zeros((*shape, dim // per_int), dtype=mx.uint32),
        mx.zeros((*shape, dim // group_size), dtype=dtype),
        mx.zeros((*shape, dim // group_size), dtype=dtype),
    )


class MergeableQuantizedKVCache(QuantizedKVCache):
    """One sequence's quantized KV that can join a batch again."""

    @classmethod
    def merge(cls, caches):
        return BatchQuantizedKVCache.merge(caches)

    def size(self):
        return self.offset

    @property
    def nbytes(self):
        # mlx-lm's QuantizedKVCache.nbytes fails on a fresh cache (keys None); admission asks
        # the generator's byte count while a row's new cache has not been written yet.
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))


class BatchQuantizedKVCache(BatchKVCache):
    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys, values):
        prev = self._idx
        if self.keys is None or (prev + keys.shape[2]) > self.keys[0].shape[2]:
            B, heads, _, k_dim = keys.shape
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            shape = (B, heads, n_steps * self.step)
            new_k = _zeros(shape, k_dim, keys.dtype, self.group_size, self.bits)
            new_v = _zeros(shape, values.shape[3], values.dtype, self.group_size, self.bits)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys, self.values = tree_map(lambda x: x[..., :prev, :], (self.keys, self.values))
                self.keys = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(self.keys, new_k))
                self.values = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(self.values, new_v))
            else:
                self.keys, self.values = new_k, new_v
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        for buf, new in ((self.keys, keys), (self.values, values)):
            for part, q in zip(buf, _quantize(new, self.group_size, self.bits)):
                part[..., prev : self._idx, :] = q
        return self.keys_and_values()

    def keys_and_values(self):
        return tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))

    def finalize(self):
        if self._right_padding is not None:
            padding = self._right_padding[:, None]
            self.keys, self.values = tree_map(lambda x: dynamic_roll(x, padding, axis=2), (self.keys, self.values))
            self.offset = self.offset - self._right_padding
            self.left_padding += self._right_padding
            self._right_padding = None

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def filter(self, batch_indices):
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        min_left_pad = min(self.left_padding.tolist())
        if min_left_pad > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(lambda x: x[..., min_left_pad:, :], (self.keys, self.values))
            self._idx -= min_left_pad
            self.left_padding -= min_left_pad

    def extend(self, other):
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        max_idx = max(self._idx, other._idx)
        template = self.keys if self.keys is not None else other.keys
        template_v = self.values if self.values is not None else other.values
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c):
            k, v = c.keys, c.values
            if k is None:
                rows = c.offset.shape[0]
                k = tuple(mx.zeros((rows, t.shape[1], 0, t.shape[3]), dtype=t.dtype) for t in template)
                v = tuple(mx.zeros((rows, t.shape[1], 0, t.shape[3]), dtype=t.dtype) for t in template_v)
            left = max_idx - c._idx
            right = max_size - k[0].shape[2] - left
            if right < 0:
                k, v = tree_map(lambda x: x[..., :right, :], (k, v))
                right = 0
            if left or right:
                k, v = tree_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]), (k, v))
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, l1), (k2, v2, o2, l2) = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2))
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([l1, l2])
        self._idx = max_idx

    def extract(self, idx):
        cache = MergeableQuantizedKVCache(group_size=self.group_size, bits=self.bits)
        padding = self.left_padding.tolist()[idx]
        cache.keys, cache.values = tree_map(
            lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]), (self.keys, self.values)
        )
        cache.offset = cache.keys[0].shape[2]
        return cache

    @classmethod
    def merge(cls, caches):
        first = next((c for c in caches if isinstance(c, QuantizedKVCache)), None)
        group_size, bits = (first.group_size, first.bits) if first is not None else (64, 8)
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), group_size, bits)
        padding = [longest - n for n in lengths]
        full = next(c for c in caches if c.keys is not None)
        rows = len(caches)

        def empty(parts):
            return tuple(mx.zeros((rows, p.shape[1], longest, p.shape[3]), dtype=p.dtype) for p in parts)

        keys, values = empty(full.keys), empty(full.values)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            for buf, src in ((keys, c.keys), (values, c.values)):
                for part, s in zip(buf, src):
                    part[i : i + 1, :, p : p + c.offset] = s[..., : c.offset, :]
        cache = cls(padding, group_size, bits)
        cache.keys, cache.values = keys, values
        cache.offset += longest
        cache._idx = longest
        return cache

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))


def quantize_layers(cache: list, group_size: int, bits: int) -> list:
    """A fresh sequence cache with its plain KV layers quantized (other kinds unchanged)."""
    out = []
    for layer in cache:
        if type(layer) is KVCache and layer.keys is None:
            out.append(MergeableQuantizedKVCache(group_size=group_size, bits=bits))
        else:
            out.append(layer)
    return out


def _register_for_load() -> None:
    """mlx-lm's load_prompt_cache finds a layer's class by name in its cache module: the
    prefix cache's disk tier writes MergeableQuantizedKVCache layers, so it must be there."""
    from mlx_lm.models import cache as mlx_cache

    if not hasattr(mlx_cache, MergeableQuantizedKVCache.__name__):
        setattr(mlx_cache, MergeableQuantizedKVCache.__name__, MergeableQuantizedKVCache)


_register_for_load()
