"""Per-architecture knowledge: config.json from GGUF metadata, and llama.cpp's tensor names
(as convert_hf_to_gguf writes them) to mlx-lm's, with llama.cpp's changes to the weights undone.

Every hyper-parameter is range-checked and cross-checked against the tensors, so a lying
header (block_count = 1e9) is refused before a model is built from it."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from .reader import GGUFHeader


class UnsupportedModel(ValueError):
    pass


# Upper bounds far above any real model, far below what could exhaust memory.
_LIMITS = {
    "block_count": 1024,
    "embedding_length": 1 << 17,
    "feed_forward_length": 1 << 20,
    "attention.head_count": 1024,
    "attention.head_count_kv": 1024,
    "attention.key_length": 4096,
    "attention.value_length": 4096,
    "context_length": 1 << 24,
    "attention.sliding_window": 1 << 24,
    "rope.dimension_count": 4096,
    "rope.scaling.original_context_length": 1 << 24,
}


def _int(md: dict, arch: str, key: str, default: int | None = None) -> int:
    full = f"{arch}.{key}"
    value = md.get(full, default)
    if value is None:
        raise UnsupportedModel(f"GGUF metadata lacks required key {full!r}")
    if isinstance(value, list):
        raise UnsupportedModel(f"GGUF metadata {full!r} is per-layer (an array), which is not supported")
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= _LIMITS[key]:
        raise UnsupportedModel(f"GGUF metadata {full!r} = {value!r} is out of range (1 to {_LIMITS[key]})")
    return value


def _float(md: dict, arch: str, key: str, default: float | None = None, low: float = 0.0, high: float = 1e12) -> float:
    full = f"{arch}.{key}"
    value = md.get(full, default)
    if value is None:
        raise UnsupportedModel(f"GGUF metadata lacks required key {full!r}")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise UnsupportedModel(f"GGUF metadata {full!r} = {value!r} is not a number")
    if not low < value <= high:
        raise UnsupportedModel(f"GGUF metadata {full!r} = {value!r} is out of range")
    return float(value)


# llama.cpp block tensor names -> mlx-lm names, per family.
_LLAMA_BLOCK = {
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
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 2/3 have four norms per block; llama.cpp's `ffn_norm` is the pre-feed-forward one.
_GEMMA_BLOCK = {
    **_LLAMA_BLOCK,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 keeps fused QKV and gate/up projections, as Hugging Face's checkpoint does.
_PHI3_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Parameter suffixes: plain weights and biases, and MLX's affine-quantized triplet parts.
_SUFFIXES = ("weight", "bias", "scales", "biases")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(" + "|".join(_SUFFIXES) + r")$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(" + "|".join(_SUFFIXES) + r")$")
_BLOCK_INDEX_RE = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class Architecture:
    name: str
    build_config: Callable[[dict], dict]
    block_names: dict[str, str] = field(default_factory=lambda: _LLAMA_BLOCK)
    # llama.cpp permutes Q/K rows for llama-architecture models only.
    permute_qk: bool = False
    # Gemma's norms compute x * (1 + w); llama.cpp stores 1 + w, mlx-lm expects w.
    norm_shift: float = 0.0

    def map_tensor_name(self, name: str) -> str:
        """llama.cpp name -> mlx-lm name; raises on anything unknown (never drop silently)."""
        m = _BLOCK_RE.match(name)
        if m and m.group(2) in self.block_names:
            return f"model.layers.{m.group(1)}.{self.block_names[m.group(2)]}.{m.group(3)}"
        m = _TOP_RE.match(name)
        if m and m.group(1) in _TOP_NAMES:
            return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
        raise UnsupportedModel(f"GGUF tensor {name!r} has no mapping to an mlx-lm {self.name} parameter")


def unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (its converter interleaves rotary halves).

    Quantization groups run along columns, so the packed weight, scales and biases of a
    quantized tensor share the row order and are all un-permuted the same way."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _common_config(md: dict, arch: str, model_type: str) -> dict:
    n_head = _int(md, arch, "attention.head_count")
    n_kv = _int(md, arch, "attention.head_count_kv", n_head)
    if n_head % n_kv:
        raise UnsupportedModel(f"{arch}: {n_head} attention heads do not divide into {n_kv} KV heads")
    hidden = _int(md, arch, "embedding_length")
    head_dim = _int(md, arch, "attention.key_length", hidden // n_head or 1)
    if _int(md, arch, "attention.value_length", head_dim) != head_dim:
        raise UnsupportedModel(f"{arch}: a value length different from the key length is not supported")
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": _int(md, arch, "block_count"),
        "intermediate_size": _int(md, arch, "feed_forward_length"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _float(md, arch, "attention.layer_norm_rms_epsilon", high=1.0),
        "rope_theta": _float(md, arch, "rope.freq_base", 10000.0),
        "max_position_embeddings": _int(md, arch, "context_length", 4096),
    }
    if model_type != "phi3" and _int(md, arch, "rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedModel(f"{arch}: partial rotary embeddings (rope.dimension_count) are not supported")
    scaling = md.get(f"{arch}.rope.scaling.type")
    allowed = {"gemma3_text": "linear", "ministral3": "yarn"}
    if scaling not in (None, "none") and scaling != allowed.get(model_type):
        raise UnsupportedModel(f"{arch}: rope scaling {scaling!r} is not supported by the importer")
    return config


def _llama_config(md: dict) -> dict:
    config = _common_config(md, "llama", "llama")
    if md.get("llama.expert_count"):
        raise UnsupportedModel("llama: mixture-of-experts GGUF files (Mixtral) are not supported")
    config.update(attention_bias=False, mlp_bias=False)
    return config


def _qwen2_config(md: dict) -> dict:
    return _common_config(md, "qwen2", "qwen2")


def _qwen3_config(md: dict) -> dict:
    return _common_config(md, "qwen3", "qwen3")


def _gemma_attention_scale(config: dict, layers_27b: int) -> int:
    # llama.cpp scales queries by 1/sqrt(head_dim), except for the 27B models, which use
    # hidden / heads (Hugging Face's query_pre_attn_scalar for them; an int in its config).
    if config["num_hidden_layers"] == layers_27b:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _gemma2_config(md: dict) -> dict:
    config = _common_config(md, "gemma2", "gemma2")
    config.update(
        query_pre_attn_scalar=_gemma_attention_scale(config, 46),
        attn_logit_softcapping=_float(md, "gemma2", "attn_logit_softcapping", 50.0),
        final_logit_softcapping=_float(md, "gemma2", "final_logit_softcapping", 30.0),
    )
    return config


def _gemma3_config(md: dict) -> dict:
    config = _common_config(md, "gemma3", "gemma3_text")
    config.update(
        query_pre_attn_scalar=_gemma_attention_scale(config, 62),
        sliding_window=_int(md, "gemma3", "attention.sliding_window", 512),
        # llama.cpp fixes these for Gemma 3 (llama-model.cpp): 5 local layers per global one.
        sliding_window_pattern=6,
        rope_local_base_freq=10000.0,
    )
    if md.get("gemma3.rope.scaling.type") == "linear":
        factor = _float(md, "gemma3", "rope.scaling.factor", high=1e6)
        config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    return config


def _phi3_config(md: dict) -> dict:
    config = _common_config(md, "phi3", "phi3")
    if config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
        raise UnsupportedModel("phi3: head_dim x heads must equal the embedding length")
    rotary = _int(md, "phi3", "rope.dimension_count", config["head_dim"])
    config["partial_rotary_factor"] = rotary / config["head_dim"]
    config["original_max_position_embeddings"] = _int(md, "phi3", "context_length", 4096)
    return config


def _mistral3_config(md: dict) -> dict:
    """Ministral 3 as llama.cpp writes it (`mistral3`): a llama block with YaRN rope and
    Llama 4's attention temperature, q * (1 + beta * log(1 + floor(pos / original_ctx)))."""
    config = _common_config(md, "mistral3", "ministral3")
    if md.get("mistral3.expert_count"):
        raise UnsupportedModel("mistral3: mixture-of-experts GGUF files are not supported")
    original = _int(md, "mistral3", "context_length", 4096)
    rope = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    if md.get("mistral3.rope.scaling.type") == "yarn":
        original = _int(md, "mistral3", "rope.scaling.original_context_length", original)
        rope.update(
            rope_type="yarn",
            factor=_float(md, "mistral3", "rope.scaling.factor", high=1e6),
            beta_fast=_float(md, "mistral3", "rope.scaling.yarn_beta_fast", 32.0, high=1e6),
            beta_slow=_float(md, "mistral3", "rope.scaling.yarn_beta_slow", 1.0, high=1e6),
            # llama.cpp's mistral3 graph cancels YaRN's magnitude correction (its attn_factor
            # is 1 / (1 + 0.1 ln factor)); equal mscales make mlx-lm's ratio 1 as well.
            mscale=1.0,
            mscale_all_dim=1.0,
        )
    temperature_length = md.get("mistral3.attention.temperature_length", original)
    if temperature_length != original:
        raise UnsupportedModel(
            f"mistral3: attention.temperature_length {temperature_length!r} differs from the original "
            f"context {original} (mlx-lm's ministral3 uses one value for both)"
        )
    rope["original_max_position_embeddings"] = original
    beta = md.get("mistral3.attention.temperature_scale", 0.0)
    rope["llama_4_scaling_beta"] = _float(md, "mistral3", "attention.temperature_scale", 0.0, low=-1.0) if beta else 0.0
    config.update(rope_parameters=rope, attention_bias=False, mlp_bias=False)
    return config


ARCHITECTURES = {
    "llama": Architecture("llama", _llama_config, permute_qk=True),
    "qwen2": Architecture("qwen2", _qwen2_config),
    "qwen3": Architecture("qwen3", _qwen3_config, {**_LLAMA_BLOCK, **_QK_NORM}),
    "gemma2": Architecture("gemma2", _gemma2_config, _GEMMA_BLOCK, norm_shift=1.0),
    "gemma3": Architecture("gemma3", _gemma3_config, {**_GEMMA_BLOCK, **_QK_NORM}, norm_shift=1.0),
    "phi3": Architecture("phi3", _phi3_config, _PHI3_BLOCK),
    # Mistral 3 GGUFs: `llama` from older llama.cpp (imported as llama), `mistral3` since
    # Ministral 3; both carry llama's Q/K row permutation (llama.cpp's NORM rope).
    "mistral3": Architecture("mistral3", _mistral3_config, permute_qk=True),
}


def architecture_for(md: dict) -> Architecture:
    name = md.get("general.architecture")
    if name not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModel(f"unsupported GGUF architecture {name!r}; supported: {supported}")
    return ARCHITECTURES[name]


def check_against_tensors(config: dict, header: GGUFHeader) -> None:
    """The header's hyper-parameters must describe the tensors really in the file; sets
    vocab_size from the embedding (the rows a token id may index)."""
    blocks = {int(m.group(1)) for t in header.tensors if (m := _BLOCK_INDEX_RE.match(t.name))}
    layers = config["num_hidden_layers"]
    if blocks != set(range(layers)):
        raise UnsupportedModel(f"block_count is {layers}, but the file holds tensors for {len(blocks)} blocks")
    embed = header.tensor("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise UnsupportedModel("the GGUF file has no 2-D token_embd.weight tensor")
    if embed.shape[0] != config["hidden_size"]:
        raise UnsupportedModel(
            f"embedding_length is {config['hidden_size']}, but token_embd.weight has rows of {embed.shape[0]}"
        )
    config["vocab_size"] = embed.shape[1]
    n_tokens = len(header.metadata.get("tokenizer.ggml.tokens", []))
    if not 0 < n_tokens <= embed.shape[1]:
        raise UnsupportedModel(f"the vocabulary has {n_tokens} tokens for an embedding of {embed.shape[1]} rows")
