"""Per-architecture knowledge: config.json from GGUF metadata, and tensor names to mlx-lm's."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


class UnsupportedModel(ValueError):
    pass


def _scalar(md: dict, key: str, default: Any = None) -> Any:
    if key not in md:
        if default is None:
            raise UnsupportedModel(f"GGUF metadata lacks required key {key!r}")
        return default
    value = md[key]
    if isinstance(value, mx.array):
        return value.item()
    return value


# llama.cpp block tensor names -> Hugging Face / mlx-lm names (shared by llama and qwen2).
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Parameter suffixes: plain weights and biases, and MLX's affine-quantized triplet parts.
_SUFFIXES = ("weight", "bias", "scales", "biases")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(" + "|".join(_SUFFIXES) + r")$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(" + "|".join(_SUFFIXES) + r")$")


def map_tensor_name(name: str) -> str:
    """llama.cpp name -> mlx-lm name; raises on anything we do not know (never drop silently)."""
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    m = _TOP_RE.match(name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise UnsupportedModel(f"GGUF tensor {name!r} has no mapping to an mlx-lm parameter")


def unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (its converter interleaves rotary halves).

    Quantization groups run along columns, so the packed weight, scales and biases of a
    quantized tensor share the row order and are all un-permuted the same way."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class Architecture:
    name: str
    build_config: Callable[[dict], dict]
    # llama.cpp permutes Q/K rows for llama-architecture models only.
    permute_qk: bool


def _common_config(md: dict, arch: str, model_type: str) -> dict:
    n_head = int(_scalar(md, f"{arch}.attention.head_count"))
    hidden = int(_scalar(md, f"{arch}.embedding_length"))
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(md, f"{arch}.block_count")),
        "intermediate_size": int(_scalar(md, f"{arch}.feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_scalar(md, f"{arch}.attention.head_count_kv", n_head)),
        "rms_norm_eps": float(_scalar(md, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(md, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_scalar(md, f"{arch}.context_length", 4096)),
        "vocab_size": int(_scalar(md, f"{arch}.vocab_size", len(md.get("tokenizer.ggml.tokens", [])) or None)),
    }
    key_length = md.get(f"{arch}.attention.key_length")
    if key_length is not None:
        config["head_dim"] = int(_scalar(md, f"{arch}.attention.key_length"))
    else:
        config["head_dim"] = hidden // n_head
    scaling = md.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModel(f"rope scaling {scaling!r} is not supported by the importer yet")
    return config


def _llama_config(md: dict) -> dict:
    config = _common_config(md, "llama", "llama")
    config.update(attention_bias=False, mlp_bias=False)
    return config


def _qwen2_config(md: dict) -> dict:
    return _common_config(md, "qwen2", "qwen2")


ARCHITECTURES = {
    "llama": Architecture("llama", _llama_config, permute_qk=True),
    "qwen2": Architecture("qwen2", _qwen2_config, permute_qk=False),
}


def architecture_for(md: dict) -> Architecture:
    name = md.get("general.architecture")
    if name not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModel(f"unsupported GGUF architecture {name!r}; supported: {supported}")
    return ARCHITECTURES[name]
