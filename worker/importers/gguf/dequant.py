"""Dequantize the ggml tensor types we do not hand to MLX's GGUF reader, with gguf-py
(llama.cpp's own Python package, numpy reference implementations of every block format).

MLX's reader loads F32/F16/BF16 and Q4_0/Q4_1/Q8_0 (as its own affine triplets, which
--keep-quant keeps) correctly. For K-quants it was measured wrong: on Gemma 3 270M's Q4_K
tensors mx.load differs from llama.cpp's dequantization by up to 0.77 (weights of magnitude
about 1), and it cannot read Q3_K, Q5_K, Q5_0, Q5_1 or the IQ types at all."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .reader import GGML_TYPES, GGUFHeader, TensorInfo

NUMPY_TENSOR_TYPES = {
    "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS",
}  # fmt: skip


def load_tensor(path: Path, header: GGUFHeader, info: TensorInfo) -> np.ndarray:
    """One tensor, dequantized to float32, in numpy's (row-major) shape."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=header.data_offset + info.offset, shape=(info.nbytes,))
    rows = info.nbytes // (info.shape[0] // GGML_TYPES[info.type_id][1] * GGML_TYPES[info.type_id][2])
    values = dequantize(np.asarray(raw).reshape(rows, -1), GGMLQuantizationType(info.type_id))
    return values.astype(np.float32).reshape(tuple(reversed(info.shape)))
