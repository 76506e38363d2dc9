"""Tiny random-weight models written twice: as an mlx-lm folder and as a GGUF file, the GGUF
the way llama.cpp's convert_hf_to_gguf.py writes it (its tensor names, its Q/K row permutation
for llama, its `1 + w` for Gemma norms, its metadata keys), with the `gguf` package's writer.

The name table here is written from llama.cpp's gguf-py tensor_mapping, independently of the
importer's, so an import that maps a tensor wrongly fails the logit comparison."""

from __future__ import annotations

from pathlib import Path

import numpy as np

BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "vocab_size": 300,
}
CONFIGS = {
    "llama": {"model_type": "llama", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
    "qwen3": {"model_type": "qwen3", "tie_word_embeddings": True},
    "gemma2": {
        "model_type": "gemma2",
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma3": {
        "model_type": "gemma3_text",
        "query_pre_attn_scalar": 16,
        "sliding_window": 4,
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "num_hidden_layers": 6,
    },
    "phi3": {"model_type": "phi3", "num_key_value_heads": 4, "tie_word_embeddings": False},
}
# Mistral (and Llama 2) GGUFs say `llama`, with a SentencePiece vocabulary.
CONFIGS["mistral"] = CONFIGS["llama"]
# Ministral 3 (`mistral3` in llama.cpp): YaRN rope and Llama 4's attention temperature. A
# tiny original context (4) makes the temperature reach the test's ten positions.
CONFIGS["mistral3"] = {
    "model_type": "ministral3",
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 4,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.1,
    },
}
GGUF_ARCH = {"mistral": "llama"}
# mlx-lm (Hugging Face) names -> llama.cpp names, from gguf-py's tensor_mapping.py.
_COMMON = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
}
_POST_ATTENTION = {
    "llama": {"post_attention_layernorm": "ffn_norm"},
    "qwen3": {"post_attention_layernorm": "ffn_norm"},
    "phi3": {"post_attention_layernorm": "ffn_norm"},
    "gemma2": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
}
_POST_ATTENTION["gemma3"] = _POST_ATTENTION["gemma2"]
_POST_ATTENTION["mistral"] = _POST_ATTENTION["llama"]
_POST_ATTENTION["mistral3"] = _POST_ATTENTION["llama"]
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def mlx_config(arch: str) -> dict:
    return {**BASE, **CONFIGS[arch]}


def gguf_name(arch: str, name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    _, _, index, rest = name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    table = {**_COMMON, **_POST_ATTENTION[arch]}
    return f"blk.{index}.{table[module]}.{suffix}"


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_PERMUTED = ("llama", "mistral", "mistral3")  # convert_hf_to_gguf's LlamaModel subclasses


def to_llama_cpp(arch: str, config: dict, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, w in weights.items():
        if arch in _PERMUTED and name.endswith("self_attn.q_proj.weight"):
            w = _llama_permute(w, config["num_attention_heads"])
        elif arch in _PERMUTED and name.endswith("self_attn.k_proj.weight"):
            w = _llama_permute(w, config["num_key_value_heads"])
        elif arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1.0  # Gemma's RMSNorm multiplies by (1 + w); llama.cpp stores 1 + w
        out[gguf_name(arch, name)] = w
    return out


def byte_level_vocab(n: int) -> tuple[list[str], list[int]]:
    """GPT-2's printable byte alphabet, then filler tokens, then two control tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    tokens = alphabet + [f"tok{i}" for i in range(n - len(alphabet) - 2)] + ["<|im_start|>", "<|im_end|>"]
    return tokens, [1] * (n - 2) + [3, 3]


def sentencepiece_vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, the 256 byte tokens, then word pieces (scores favour longer merges)."""
    # In score order: "▁hello" is reached by merges ▁h, ▁he, ll, llo, ▁hello; el and lo lose.
    pieces = ["\u2581", "h", "e", "l", "o", "\u2581h", "\u2581he", "ll", "llo", "\u2581hello", "el", "lo"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    tokens += [f"\u2581w{i}" for i in range(n - len(tokens))]
    scores = [0.0] * 259 + [-float(i) for i in range(n - 259)]
    types = [2, 3, 3] + [6] * 256 + [1] * (n - 259)
    return tokens, scores, types


SIMPLE_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _add_tokenizer(writer, arch: str, n_vocab: int, chat_template: str = SIMPLE_TEMPLATE) -> None:
    if arch in ("gemma2", "gemma3", "phi3", "mistral"):
        tokens, scores, types = sentencepiece_vocab(n_vocab)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(arch in ("phi3", "mistral"))
    else:
        tokens, types = byte_level_vocab(n_vocab)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges([])
        writer.add_eos_token_id(n_vocab - 1)
    writer.add_chat_template(chat_template)


def _add_hparams(writer, arch: str, c: dict) -> None:
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(c["rope_theta"])
    if arch != "phi3":
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
    if arch == "phi3":
        writer.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(c["final_logit_softcapping"])
    if arch == "gemma3":
        writer.add_sliding_window(c["sliding_window"])
    if arch == "mistral3":  # as convert_hf_to_gguf's Ministral3Model writes them
        import gguf

        rope = c["rope_parameters"]
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])


def write_twice(
    arch: str, dest: Path, seed: int = 0, split_max_tensors: int = 0, chat_template: str = SIMPLE_TEMPLATE
) -> tuple[Path, Path]:
    """(mlx-lm folder, GGUF file) holding the same random weights (and the GGUF that chat template)."""
    import gguf
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, save_config, save_model

    config = mlx_config(arch)
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    # Random norms too (they start at ones or zeros), so a missed norm shift shows in the logits.
    params = dict(tree_flatten(model.parameters()))
    params = {k: (mx.random.normal(v.shape) * 0.5 if k.endswith("norm.weight") else v) for k, v in params.items()}
    if arch == "gemma3":
        del params["lm_head.weight"]  # Gemma ties its output to the embedding
    params = model.sanitize(params) if hasattr(model, "sanitize") else params
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())
    folder = dest / f"{arch}-mlx"
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, model)
    save_config(config, folder / "config.json")

    numpy_weights = {k: np.array(v.astype(mx.float32)) for k, v in params.items()}
    path = dest / f"{arch}.gguf"
    writer = gguf.GGUFWriter(path, GGUF_ARCH.get(arch, arch), split_max_tensors=split_max_tensors)
    _add_hparams(writer, arch, config)
    _add_tokenizer(writer, arch, config["vocab_size"], chat_template)
    for name, w in to_llama_cpp(arch, config, numpy_weights).items():
        writer.add_tensor(name, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return folder, path


# --- Quantized tensors: one GGUF per ggml type, next to an mlx-lm folder holding exactly what
# llama.cpp's reference (gguf-py's numpy dequantize) reads back from the same bytes.

# Row lengths must be multiples of 256 for the K and IQ types' super-blocks.
QUANT_BASE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
# Where each block's fp16 scale(s) sit, for the types gguf-py cannot quantize: random bytes
# make valid quant codes and grid indices, but a random fp16 scale can be inf or NaN.
_FP16_SCALE_OFFSETS = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ2_XXS": (0,),
    "IQ2_XS": (0,),
    "IQ2_S": (0,),
    "IQ3_XXS": (0,),
    "IQ3_S": (0,),
    "IQ1_S": (0,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}


def quantized_bytes(qtype: str, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """w (rows, cols) as ggml blocks of qtype: gguf-py's quantizer where it has one, else
    random blocks with small, finite scales (what matters is reading them back exactly)."""
    import gguf
    from gguf.quants import quantize

    t = gguf.GGMLQuantizationType[qtype]
    if qtype not in _FP16_SCALE_OFFSETS:
        return quantize(w, t)
    block_size, type_size = gguf.GGML_QUANT_SIZES[t]
    rows, cols = w.shape
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in _FP16_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(2e-4, 1e-3, size=blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(*scale.shape, 2)
    return blocks.reshape(rows, -1)


def write_quantized(qtype: str, dest: Path, arch: str = "qwen3", seed: int = 0) -> tuple[Path, Path]:
    """(mlx-lm folder, GGUF file): every matrix stored as qtype in the GGUF (norms stay F32, as
    llama.cpp keeps them), and the folder holding gguf-py's dequantization of those bytes."""
    import gguf
    import mlx.core as mx
    from gguf.quants import dequantize
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, save_config, save_model

    assert arch not in ("llama", "mistral") and not arch.startswith("gemma"), "no weight transforms here"
    config = {**mlx_config(arch), **QUANT_BASE}
    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    params = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
    path = dest / f"{arch}-{qtype}.gguf"
    writer = gguf.GGUFWriter(path, arch)
    _add_hparams(writer, arch, config)
    _add_tokenizer(writer, arch, config["vocab_size"])
    reference = {}
    t = gguf.GGMLQuantizationType[qtype]
    for name, w in params.items():
        w = rng.normal(0, 0.5, w.shape).astype(np.float32) if name.endswith("norm.weight") else w
        if w.ndim == 2:
            raw = quantized_bytes(qtype, w, rng)
            w = dequantize(raw, t).astype(np.float32).reshape(w.shape)
            writer.add_tensor(gguf_name(arch, name), raw, raw_dtype=t)
        else:
            writer.add_tensor(gguf_name(arch, name), w)
        reference[name] = mx.array(w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_weights(list(reference.items()))
    folder = dest / f"{arch}-{qtype}-mlx"
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, model)
    save_config(config, folder / "config.json")
    return folder, path
