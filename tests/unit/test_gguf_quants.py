"""Every ggml tensor type the importer accepts: a tiny
random-weight qwen3 model whose matrices are stored in that type, written as a GGUF and, next
to it, as an mlx-lm folder holding llama.cpp's own dequantization (gguf-py's numpy reference)
of the same bytes. After import the logits equal that folder's.

Tolerance: absolute 1e-4 on float32 logits, as for the architectures (test_gguf_archs.py).
For Q4_0, Q4_1 and Q8_0 `--keep-quant` keeps MLX's affine triplets with their float16 scales
(as the GGUF stores them): MLX's quantized matmul then rounds each weight to float16 (relative
2^-11), which moves logits of magnitude 2 by about 1e-3 (measured: at most 1.0e-3), so that
comparison allows absolute 5e-3."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the GGUF writer for these tests: pip install -e '.[test]'")

from helpers.gguf_models import write_quantized  # noqa: E402

TOKENS = [[1, 5, 17, 42, 299, 3, 7, 100, 250, 11]]
ATOL = 1e-4
KEEP_QUANT_ATOL = 5e-3
# IQ1_M is left out: its fp16 scale is spread over four nibbles of the block's scales.
QUANT_TYPES = [
    "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ4_NL", "IQ4_XS",
]  # fmt: skip


def _logits(folder) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    out = np.array(model(mx.array(TOKENS)).astype(mx.float32))
    assert np.isfinite(out).all()
    return out


def _import(source, name, models_dir, **options):
    from mlxgw.worker.importers.gguf import import_gguf

    return import_gguf(str(source), name, dtype="float32", models_dir=models_dir, **options)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_imported_tensor_type_reads_back_as_llama_cpp_dequantizes_it(tmp_path, qtype):
    folder, gguf_file = write_quantized(qtype, tmp_path)
    result = _import(gguf_file, f"q-{qtype.lower()}", tmp_path / "models")
    np.testing.assert_allclose(_logits(result.path), _logits(folder), atol=ATOL, rtol=0)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_keep_quant_keeps_mlx_affine_weights_with_the_same_logits(tmp_path, qtype):
    import json

    folder, gguf_file = write_quantized(qtype, tmp_path)
    result = _import(gguf_file, f"k-{qtype.lower()}", tmp_path / "models", keep_quant=True)
    config = json.loads((result.path / "config.json").read_text())
    assert config["quantization"]["group_size"] == 32
    np.testing.assert_allclose(_logits(result.path), _logits(folder), atol=KEEP_QUANT_ATOL, rtol=0)
