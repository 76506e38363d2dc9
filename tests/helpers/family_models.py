"""Tiny random-weight models of many mlx-lm families, built from mlx-lm's own model classes.

Every family keeps its layer kinds (full and sliding-window attention, gated DeltaNet,
Mamba/SSM, short convolutions, MoE, MLA) at hidden size 64 with a few layers, a 16-token
window for the sliding-window ones, and SmolLM2's real tokenizer and chat template. The
output head is scaled so that random logits are far from flat: greedy parity with mlx-lm
then means the same computation, not a coin that lands the same way on near-ties.

`FAMILIES` maps a family name to its config overrides; `build_family_model` writes a folder
mlx_lm.load() (and so mlxgw) loads. Nested-args families (Qwen3.5) are written with their
`text_config`, as the real mlx-community folders are."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# A llama with 64-wide heads: quantized KV (kv_bits) needs heads its groups (32+) divide.
WIDE_HEADS = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}
WINDOW = 16  # sliding window of the sliding-window families: short prompts already wrap it
LOGIT_SPREAD = 6.0  # std of the scaled output logits (random init gives ~1: nearly flat)

_ATTN = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
_BASE = {**_ATTN, "intermediate_size": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_LINEAR = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
_QWEN35_TEXT = {
    **_BASE,
    **_LINEAR,
    "model_type": "qwen3_5_text",
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
}

FAMILIES: dict[str, dict] = {
    "llama": {**_BASE, "num_hidden_layers": 2, "tie_word_embeddings": True},
    "qwen3": {**_BASE, "num_hidden_layers": 2, "tie_word_embeddings": True, "rope_theta": 10000.0},
    "qwen3_moe": {
        **_BASE,
        **_MOE,
        "num_hidden_layers": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "norm_topk_prob": True,
    },
    "qwen3_5": {"text_config": _QWEN35_TEXT, "tie_word_embeddings": True},
    "qwen3_5_moe": {
        "text_config": {
            **_QWEN35_TEXT,
            **_MOE,
            "model_type": "qwen3_5_moe_text",
            "shared_expert_intermediate_size": 32,
            "decoder_sparse_step": 1,
        },
        "tie_word_embeddings": True,
    },
    "qwen3_next": {
        **_BASE,
        **_LINEAR,
        **_MOE,
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 32,
        "mlp_only_layers": [],
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        **_BASE,
        "num_hidden_layers": 3,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 16,
    },
    "gemma4_text": {
        **_BASE,
        "num_hidden_layers": 4,
        "global_head_dim": 32,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 8,
        "final_logit_softcapping": 30.0,
        "use_double_wide_mlp": False,
    },
    "gpt_oss": {
        **_BASE,
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_theta": 10000.0,
    },
    "olmo3": {
        **_BASE,
        "num_hidden_layers": 4,
        "sliding_window": WINDOW,
        "rope_theta": 10000.0,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    },
    "lfm2": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "full_attn_idxs": [1, 3],
        "tie_word_embeddings": True,
    },
    "granitemoehybrid": {
        **_BASE,
        "num_hidden_layers": 4,
        "attention_bias": False,
        "embedding_multiplier": 1.0,
        "attention_multiplier": 0.25,
        "logits_scaling": 1.0,
        "residual_multiplier": 1.0,
        "layer_types": ["mamba", "attention", "mamba", "attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 32,
        "mamba_proj_bias": False,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
    },
    "nemotron_h": {
        **_ATTN,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 1,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": "M*M-",
        "num_hidden_layers": 4,
        "tie_word_embeddings": True,
    },
    "mamba2": {
        "num_heads": 4,
        "head_dim": 16,
        "hidden_size": 32,
        "intermediate_size": 64,
        "state_size": 16,
        "num_hidden_layers": 2,
        "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "tie_word_embeddings": True,
        "time_step_limit": [0.0, float("inf")],
        "time_step_rank": 4,
        "chunk_size": 16,
    },
    "kimi_linear": {
        **_ATTN,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "linear_attn_config": {
            "kda_layers": [1],
            "full_attn_layers": [2],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        "model_max_length": 4096,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "moe_intermediate_size": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "tie_word_embeddings": True,
    },
    "falcon_h1": {
        **_ATTN,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 64,
        "mamba_d_state": 16,
        "mamba_n_heads": 4,
        "mamba_chunk_size": 16,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    "deepseek_v3": {
        **_ATTN,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    "glm4_moe": {
        **_BASE,
        "num_hidden_layers": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "use_qk_norm": True,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "partial_rotary_factor": 0.5,
    },
    "ministral3": {
        **_BASE,
        "num_hidden_layers": 2,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_theta": 10000.0,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 4096,
        },
    },
    "smollm3": {**_BASE, "num_hidden_layers": 4, "tie_word_embeddings": True, "no_rope_layer_interval": 2},
    "phi3": {**_BASE, "num_hidden_layers": 2, "tie_word_embeddings": False},
    "minimax": {
        **_BASE,
        "num_hidden_layers": 2,
        "num_experts_per_tok": 2,
        "num_local_experts": 4,
        "shared_intermediate_size": 0,
        "rope_theta": 10000.0,
        "rotary_dim": 8,
        "tie_word_embeddings": True,
    },
}

# What each family keeps per layer (the reuse checks differ by cache kind).
NON_TRIMMABLE = {
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "gemma3_text",
    "gemma4_text",
    "gpt_oss",
    "olmo3",
    "lfm2",
    "granitemoehybrid",
    "nemotron_h",
    "mamba2",
    "kimi_linear",
    "falcon_h1",
}


def family_config(family: str, vocab_size: int, eos: int | list | None, bos: int | None) -> dict:
    config = json.loads(json.dumps(FAMILIES[family]))  # a deep copy
    config["model_type"] = family
    ids = {"vocab_size": vocab_size, "eos_token_id": eos, "bos_token_id": bos}
    config.update(ids)
    if "text_config" in config:
        config["text_config"].update(ids)
    return config


def _spread_logits(model, config: dict) -> None:
    """Scale the output head (or the tied embedding) so the logits' std is LOGIT_SPREAD."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models.cache import make_prompt_cache

    probe = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    logits = model(probe, cache=make_prompt_cache(model))
    std = float(mx.std(logits[0, -1].astype(mx.float32)))
    factor = LOGIT_SPREAD / max(std, 1e-6)
    heads = [
        (k, v)
        for k, v in tree_flatten(model.parameters())
        if k.endswith("lm_head.weight") or k.endswith("embed_tokens.weight") or k.endswith("embeddings.weight")
    ]
    tied = not any(k.endswith("lm_head.weight") for k, _ in heads)
    chosen = [(k, v * factor) for k, v in heads if tied or k.endswith("lm_head.weight")]
    # A tied table scales the inputs too; the first norm absorbs that, the logits still spread.
    model.update(tree_unflatten(chosen))
    mx.eval(model.parameters())


def build_family_model(
    family: str, dest: Path, tokenizer_source: Path, seed: int = 0, overrides: dict | None = None
) -> Path:
    """Write a tiny random `family` model into dest (SmolLM2's tokenizer files); overrides:
    config keys to change (e.g. a head size quantized KV can group)."""
    if (dest / "config.json").exists():  # before reading the source: a built model needs none
        return dest
    config = {**_sourced_config(family, tokenizer_source), **(overrides or {})}
    return _write(dest, tokenizer_source, config, seed)


def _sourced_config(family: str, tokenizer_source: Path) -> dict:
    """The family's tiny config with the tokenizer's vocabulary and special ids."""
    source = json.loads((tokenizer_source / "config.json").read_text())
    return family_config(family, source["vocab_size"], source.get("eos_token_id"), source.get("bos_token_id"))


def build_gemma3_multimodal_folder(dest: Path, tokenizer_source: Path, seed: int = 0) -> Path:
    """A Gemma 3 folder as mlx-community ships the multimodal models: model_type gemma3,
    the text model's args under text_config, weights under language_model (mlx-lm drops the
    vision tower and serves the text model)."""
    text = family_config("gemma3_text", 0, None, None)
    source = json.loads((tokenizer_source / "config.json").read_text())
    text.pop("vocab_size")
    config = {
        "model_type": "gemma3",
        "vocab_size": source["vocab_size"],
        "eos_token_id": source.get("eos_token_id"),
        "text_config": {k: v for k, v in text.items() if k not in ("eos_token_id", "bos_token_id")},
    }
    return _write(dest, tokenizer_source, config, seed)


def build_quantized_family_model(family: str, dest: Path, tokenizer_source: Path, bits: int = 4) -> Path:
    """A family model quantized as mlx-lm's convert does (a `quantization` config)."""
    config = {**_sourced_config(family, tokenizer_source), "quantization": {"group_size": 32, "bits": bits}}
    return _write(dest, tokenizer_source, config, 0)


def _write(dest: Path, tokenizer_source: Path, config: dict, seed: int) -> Path:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes, save_config, save_model

    if (dest / "config.json").exists():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_source / name, tmp / name)
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    mx.eval(model.parameters())
    _spread_logits(model, config)
    if "quantization" in config:
        q = config["quantization"]
        nn.quantize(model, group_size=q["group_size"], bits=q["bits"])
    save_model(tmp, model)
    save_config(config, tmp / "config.json")
    tmp.rename(dest)
    return dest
