"""The output head's weight stored transposed on the CPU device, where that makes its GEMM faster.

The head is the largest matmul of a decode step: SmolLM2-135M's is 49,152 x 576 (113 MB in
float32, a fifth of the model), read whole for every step. mlx-lm computes it as `x @ W.T`
with W as the checkpoint stores it (vocabulary x hidden), and on the CPU backend that is an
OpenBLAS sgemm with a transposed operand. The same product over a contiguous (hidden x
vocabulary) copy, `x @ Wt`, measured 0.60x the time at batch 1, 0.75x at 8, 0.63x at 16 and
0.70x at 32 on the 2-core development machine (bench/HISTORY.md at 3b9d616, "The forward itself on the CPU"); the other
projections gained less or lost (a 192 x 576 one was 1.2x slower), so only the head is changed.

The transposed copy replaces the original, so memory stays the same: a tied head (the input
embedding used as the output projection) keeps one (hidden x vocabulary) array and looks its
input rows up as columns, a strided gather of a few hundred values per token. Both modules
still answer `.weight` (a transposed view), which some families read directly.

Which layout is faster depends on the host, not only on the shapes: on the machine of those
figures the transposed copy won at every batch, on another machine of the same kind (an AMD
EPYC with twice the memory bandwidth, 2026-12-03) it lost at every batch, 1.72x the time at
batch 1 and 1.60x at 16, and the fixed choice made mlxgw's decode step 1.1-1.2x
mlx_lm.server's there. So the worker measures both layouts when it loads the model (a few
products at batch 1 and 8, alternated, medians; under a second for SmolLM2) and keeps the
transposed one only where it is clearly faster.

Only float32 weights on the CPU device (where matmuls are OpenBLAS calls); quantized and
half-precision heads, and any other device, are left as they are. MLXGW_TRANSPOSED_HEAD=0
turns it off, =1 transposes without measuring (comparisons, tests)."""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ....shared.platform import on_cpu_device
from ..model_info import TOKEN_EMBEDDINGS

log = logging.getLogger(__name__)

MEASURE_BATCHES = (1, 8)  # decode batches the layouts are timed at
MEASURE_REPEATS = 5  # products of each layout per batch, alternated (after one warm-up each)
KEEP_IF_BELOW = 0.95  # the transposed layout is kept where it takes under this share of the time


class TransposedHead(nn.Module):
    """nn.Linear's product from a (in x out) weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight_t = mx.contiguous(linear.weight.T)
        if "bias" in linear:
            self.bias = linear.bias

    @property
    def weight(self) -> mx.array:
        return self.weight_t.T

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.weight_t
        return y + self.bias if "bias" in self else y


class TransposedEmbedding(nn.Module):
    """nn.Embedding (lookup and as_linear) from a (dims x vocabulary) weight: a tied head."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.weight_t = mx.contiguous(embedding.weight.T)

    @property
    def weight(self) -> mx.array:
        return self.weight_t.T

    def __call__(self, ids: mx.array) -> mx.array:
        dims = self.weight_t.shape[0]
        return mx.take(self.weight_t, ids.reshape(-1), axis=1).T.reshape(*ids.shape, dims)

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.weight_t


def _float32_cpu(module: nn.Module) -> bool:
    return module.weight.dtype == mx.float32 and on_cpu_device()


def measure_layouts(weight: mx.array, weight_t: mx.array) -> float:
    """Time of `x @ weight_t` over that of `x @ weight.T` on this host, summed over
    MEASURE_BATCHES (medians of alternated products)."""
    plain_s = transposed_s = 0.0
    for batch in MEASURE_BATCHES:
        x = mx.random.normal((batch, weight.shape[1]), dtype=weight.dtype)
        mx.eval(x)
        times: dict[bool, list[float]] = {False: [], True: []}
        for repeat in range(MEASURE_REPEATS + 1):
            for transposed in (repeat % 2 == 0, repeat % 2 == 1):  # the order alternated
                started = time.perf_counter()
                mx.eval(x @ weight_t if transposed else x @ weight.T)
                if repeat:  # the first of each is a warm-up
                    times[transposed].append(time.perf_counter() - started)
        plain_s += statistics.median(times[False])
        transposed_s += statistics.median(times[True])
    return transposed_s / plain_s


def _faster_transposed(weight: mx.array, weight_t: mx.array) -> bool:
    ratio = measure_layouts(weight, weight_t)
    keep = ratio < KEEP_IF_BELOW
    log.info("output head: the transposed layout takes %.2fx the time here: %s", ratio, "kept" if keep else "not used")
    return keep


def transpose_head(model: nn.Module, choose: Callable[[mx.array, mx.array], bool] | None = None) -> str | None:
    """Replace the model's output head (an `lm_head` Linear, or the embedding it ties to) by
    its transposed form where that is faster on this host; the path of what was replaced, or
    None. choose(weight, weight_t) decides (default: measured, or always with
    MLXGW_TRANSPOSED_HEAD=1)."""
    setting = os.environ.get("MLXGW_TRANSPOSED_HEAD", "auto")
    if setting == "0":
        return None
    if choose is None:
        choose = (lambda weight, weight_t: True) if setting == "1" else _faster_transposed
    modules = dict(model.named_modules())
    heads = [name for name, m in modules.items() if name.split(".")[-1] == "lm_head"]
    if heads:
        targets = [(name, TransposedHead) for name in heads if type(modules[name]) is nn.Linear]
    else:  # tied: the token embedding is the head (named as model_info finds it)
        targets = [
            (name, TransposedEmbedding)
            for name, m in modules.items()
            if type(m) is nn.Embedding and name.split(".")[-1] in TOKEN_EMBEDDINGS
        ]
    if len(targets) != 1 or not _float32_cpu(modules[targets[0][0]]):
        return None
    name, kind = targets[0]
    parent_name, _, leaf = name.rpartition(".")
    parent = modules[parent_name] if parent_name else model
    replacement = kind(modules[name])
    mx.eval(replacement.parameters())
    if not choose(modules[name].weight, replacement.weight_t):
        return None
    setattr(parent, leaf, replacement)
    return name
