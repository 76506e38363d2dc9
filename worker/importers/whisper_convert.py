"""CTranslate2 Whisper -> MLX Whisper weights, strictly: every tensor of the source is mapped
or checked, every parameter of the MLX model is filled, every shape matches.

CTranslate2 fuses the self-attention Q/K/V projections (linear_0, 3n rows; Whisper's key has
no bias, so that third of the fused bias must be zero) and the cross-attention K/V
(linear_1, 2n rows); its Conv1d weights are (out, in, kernel) where MLX wants (out, kernel,
in). The encoder's sinusoidal positions are computed by the model, so the stored copy is
only compared."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..model.whisper.model import Whisper, WhisperDims, sinusoids

# Scalars CTranslate2 stores as variables: model settings, not weights.
SETTINGS = {
    "activation",
    "alibi",
    "alignment_heads",
    "alignment_layer",
    "num_heads",
    "pre_norm",
    "scale_embeddings",
    "start_from_zero_embedding",
    "layernorm_embedding",
    "multi_query",
}


class ConversionError(ValueError):
    pass


def dims_from(tensors: dict[str, np.ndarray]) -> WhisperDims:
    def layers(prefix: str) -> int:
        found = {int(m.group(1)) for k in tensors if (m := re.match(rf"{prefix}/layer_(\d+)/", k))}
        return max(found) + 1 if found else 0

    try:
        conv1 = tensors["encoder/conv1/weight"]
        emb = tensors["decoder/embeddings/weight"]
        return WhisperDims(
            n_mels=int(conv1.shape[1]),
            n_audio_ctx=int(tensors["encoder/position_encodings/encodings"].shape[0]),
            n_audio_state=int(conv1.shape[0]),
            n_audio_head=int(tensors["encoder/num_heads"]),
            n_audio_layer=layers("encoder"),
            n_vocab=int(emb.shape[0]),
            n_text_ctx=int(tensors["decoder/position_encodings/encodings"].shape[0]),
            n_text_state=int(emb.shape[1]),
            n_text_head=int(tensors["decoder/num_heads"]),
            n_text_layer=layers("decoder"),
        )
    except KeyError as e:
        raise ConversionError(f"not a CTranslate2 Whisper model: no {e.args[0]}") from None


def _tensor(t: dict[str, np.ndarray], name: str) -> np.ndarray:
    if name not in t:
        raise ConversionError(f"tensor {name} is missing")
    return t[name]


def _split(a: np.ndarray, n: int, parts: int) -> list[np.ndarray]:
    if a.shape[0] != n * parts:
        raise ConversionError(f"fused projection has {a.shape[0]} rows, expected {n * parts}")
    return [a[i * n : (i + 1) * n] for i in range(parts)]


def _map_block(src: str, dst: str, t: dict, n: int, cross: bool, used: set) -> dict[str, np.ndarray]:
    def get(name: str) -> np.ndarray:
        used.add(f"{src}/{name}")
        return _tensor(t, f"{src}/{name}")

    out: dict[str, np.ndarray] = {}
    q, k, v = _split(get("self_attention/linear_0/weight"), n, 3)
    qb, kb, vb = _split(get("self_attention/linear_0/bias"), n, 3)
    if np.any(kb != 0):
        raise ConversionError(f"{src}: the key projection has a bias; Whisper's has none")
    out.update({f"{dst}.attn.query.weight": q, f"{dst}.attn.key.weight": k, f"{dst}.attn.value.weight": v})
    out.update({f"{dst}.attn.query.bias": qb, f"{dst}.attn.value.bias": vb})
    out[f"{dst}.attn.out.weight"] = get("self_attention/linear_1/weight")
    out[f"{dst}.attn.out.bias"] = get("self_attention/linear_1/bias")
    out[f"{dst}.attn_ln.weight"] = get("self_attention/layer_norm/gamma")
    out[f"{dst}.attn_ln.bias"] = get("self_attention/layer_norm/beta")
    if cross:
        out[f"{dst}.cross_attn.query.weight"] = get("attention/linear_0/weight")
        out[f"{dst}.cross_attn.query.bias"] = get("attention/linear_0/bias")
        ck, cv = _split(get("attention/linear_1/weight"), n, 2)
        ckb, cvb = _split(get("attention/linear_1/bias"), n, 2)
        if np.any(ckb != 0):
            raise ConversionError(f"{src}: the cross-attention key has a bias; Whisper's has none")
        out.update({f"{dst}.cross_attn.key.weight": ck, f"{dst}.cross_attn.value.weight": cv})
        out[f"{dst}.cross_attn.value.bias"] = cvb
        out[f"{dst}.cross_attn.out.weight"] = get("attention/linear_2/weight")
        out[f"{dst}.cross_attn.out.bias"] = get("attention/linear_2/bias")
        out[f"{dst}.cross_attn_ln.weight"] = get("attention/layer_norm/gamma")
        out[f"{dst}.cross_attn_ln.bias"] = get("attention/layer_norm/beta")
    out[f"{dst}.mlp1.weight"] = get("ffn/linear_0/weight")
    out[f"{dst}.mlp1.bias"] = get("ffn/linear_0/bias")
    out[f"{dst}.mlp2.weight"] = get("ffn/linear_1/weight")
    out[f"{dst}.mlp2.bias"] = get("ffn/linear_1/bias")
    out[f"{dst}.mlp_ln.weight"] = get("ffn/layer_norm/gamma")
    out[f"{dst}.mlp_ln.bias"] = get("ffn/layer_norm/beta")
    return out


def convert(tensors: dict[str, np.ndarray], dtype: mx.Dtype) -> tuple[WhisperDims, dict[str, mx.array]]:
    """(dimensions, MLX weights by parameter name); ConversionError on anything unexpected."""
    dims = dims_from(tensors)
    used: set[str] = {k for k in tensors if k.rsplit("/", 1)[-1] in SETTINGS}
    t = tensors
    w: dict[str, np.ndarray] = {}
    for name in ("conv1", "conv2"):
        w[f"encoder.{name}.weight"] = _tensor(t, f"encoder/{name}/weight").transpose(0, 2, 1)
        w[f"encoder.{name}.bias"] = _tensor(t, f"encoder/{name}/bias")
        used.update({f"encoder/{name}/weight", f"encoder/{name}/bias"})
    stored = t["encoder/position_encodings/encodings"].astype(np.float32)
    expected = np.array(sinusoids(dims.n_audio_ctx, dims.n_audio_state))
    if stored.shape != expected.shape or np.abs(stored - expected).max() > 1e-2:
        raise ConversionError("the encoder's position encodings are not Whisper's sinusoids")
    used.add("encoder/position_encodings/encodings")
    for i in range(dims.n_audio_layer):
        w.update(_map_block(f"encoder/layer_{i}", f"encoder.blocks.{i}", t, dims.n_audio_state, False, used))
    for i in range(dims.n_text_layer):
        w.update(_map_block(f"decoder/layer_{i}", f"decoder.blocks.{i}", t, dims.n_text_state, True, used))
    for src, dst in (
        ("encoder/layer_norm/gamma", "encoder.ln_post.weight"),
        ("encoder/layer_norm/beta", "encoder.ln_post.bias"),
        ("decoder/layer_norm/gamma", "decoder.ln.weight"),
        ("decoder/layer_norm/beta", "decoder.ln.bias"),
        ("decoder/embeddings/weight", "decoder.token_embedding.weight"),
        ("decoder/position_encodings/encodings", "decoder.positional_embedding"),
    ):
        w[dst] = _tensor(t, src)
        used.add(src)
    projection = t.get("decoder/projection/weight")
    if projection is not None:
        if not np.array_equal(projection, t["decoder/embeddings/weight"]):
            raise ConversionError("the output projection is not tied to the token embeddings")
        used.add("decoder/projection/weight")
    unmapped = sorted(set(t) - used)
    if unmapped:
        raise ConversionError(f"{len(unmapped)} tensors not mapped, e.g. {unmapped[:3]}")
    return dims, _check_against_model(dims, w, dtype)


def _check_against_model(dims: WhisperDims, w: dict[str, np.ndarray], dtype: mx.Dtype) -> dict[str, mx.array]:
    expected = {k: v.shape for k, v in tree_flatten(Whisper(dims).parameters()) if not k.split(".")[-1].startswith("_")}
    missing = sorted(set(expected) - set(w))
    extra = sorted(set(w) - set(expected))
    if missing or extra:
        raise ConversionError(f"parameters missing {missing[:3]} or unexpected {extra[:3]}")
    out = {}
    for k, a in w.items():
        if tuple(a.shape) != tuple(expected[k]):
            raise ConversionError(f"{k}: shape {tuple(a.shape)}, the model expects {tuple(expected[k])}")
        out[k] = mx.array(np.ascontiguousarray(a)).astype(dtype)
    return out
