"""The output head's weight stored transposed on the CPU device, where that makes its GEMM faster.

The head is the largest matmul of a decode step: SmolLM2-135M's is 49,152 x 576 (113 MB in
float32, a fifth of the model), read whole for every step. mlx-lm computes it as `x @ W.T`
with W as the checkpoint stores it (vocabulary x hidden), and on the CPU backend that is an
OpenBLAS sgemm with a transposed operand. The same product over a contiguous (hidden x
vocabulary) copy, `x @ Wt`, measured 0.60x the time at batch 1, 0.75x at 8, 0.63x at 16 and
0.70x at 32 on the 2-core development machine (bench/README.md, "The forward itself on the CPU"); the other
projections gained less or lost (a 192 x 576 one was 1.2x slower), so only the head is changed.

The transposed copy replaces the original, so memory stays the same: a tied head (the input
embedding used as the output projection) keeps one (hidden x vocabulary) array and looks its
input rows up as columns, a strided gather of a few hundred values per token. Both modules
still answer `.weight` (a transposed view), which some families read directly.

Only float32 weights on the CPU device (where matmuls are OpenBLAS calls); quantized and
half-precision heads, and any other device, are left as they are. MLXGW_TRANSPOSED_HEAD=0
turns it off."""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from .model_info import TOKEN_EMBEDDINGS


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
    return module.weight.dtype == mx.float32 and mx.default_device().type == mx.cpu


def transpose_head(model: nn.Module) -> str | None:
    """Replace the model's output head (an `lm_head` Linear, or the embedding it ties to) by
    its transposed form; the path of what was replaced, or None."""
    if os.environ.get("MLXGW_TRANSPOSED_HEAD", "1") == "0":
        return None
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
    setattr(parent, leaf, replacement)
    return name
