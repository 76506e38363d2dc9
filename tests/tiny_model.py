"""A tiny random-weight llama that the tests build themselves: real tokenizer, real chat
template, real MLX execution, a few hundred KB of weights, so protocol tests do not wait
on the real model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
}


def build_tiny_model(dest: Path, tokenizer_source: Path, seed: int = 0, overrides: dict | None = None) -> Path:
    """Write a tiny llama into dest, with the tokenizer files of tokenizer_source (overrides:
    config keys to change, e.g. another model_type)."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, save_config, save_model

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_source / name, dest / name)
    source_config = json.loads((tokenizer_source / "config.json").read_text())
    config = dict(
        TINY_CONFIG,
        **(overrides or {}),
        vocab_size=source_config["vocab_size"],
        eos_token_id=source_config.get("eos_token_id"),
        bos_token_id=source_config.get("bos_token_id"),
    )
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    mx.eval(model.parameters())
    save_model(dest, model)
    save_config(config, dest / "config.json")
    return dest


TINY_BERT = {
    "model_type": "bert",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "pad_token_id": 0,
    "num_labels": 1,
}


def build_tiny_encoder(
    dest: Path, tokenizer_source: Path, *, model_type: str = "bert", cross_encoder: bool = True, seed: int = 0
) -> Path:
    """A random-weight BERT or XLM-RoBERTa, as a cross-encoder (…ForSequenceClassification)
    or an embedding model (mean pooling, normalised, sentence-transformers layout), with a
    real WordPiece tokenizer: exercises reranking and the architectures without a real model."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxgw.worker.model.encoder import bert

    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_source / "tokenizer.json", dest / "tokenizer.json")
    source_config = json.loads((tokenizer_source / "config.json").read_text())
    roberta = model_type == "xlm-roberta"
    config = dict(TINY_BERT, vocab_size=source_config["vocab_size"], model_type=model_type)
    if roberta:  # XLM-R: one token type, padding id 1, positions offset past it
        config.update(type_vocab_size=1, pad_token_id=1, max_position_embeddings=130)
    prefix = "XLMRoberta" if roberta else "Bert"
    config["architectures"] = [f"{prefix}ForSequenceClassification" if cross_encoder else f"{prefix}Model"]
    mx.random.seed(seed)
    model = bert.build(config, cross_encoder)
    weights = dict(tree_flatten(model.parameters()))
    if not cross_encoder:  # checkpoints of base models carry a pooler; loaders must skip it
        h = config["hidden_size"]
        weights.update({"pooler.dense.weight": mx.random.normal((h, h)) * 0.02, "pooler.dense.bias": mx.zeros((h,))})
        (dest / "modules.json").write_text(
            json.dumps(
                [
                    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
                ]
            )
        )
        (dest / "1_Pooling").mkdir(exist_ok=True)
        (dest / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    mx.save_safetensors(str(dest / "model.safetensors"), weights)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def build_tiny_vision_model(dest: Path, tokenizer_source: Path, seed: int = 0) -> Path:
    """A random-weight Qwen2-VL (mlx-vlm's qwen2_vl: vision tower, merger, mrope language
    model) at bench/serving/random_vlm.py's tiny size, with SmolLM2's tokenizer plus the vision
    tokens, and mlx-vlm's own Qwen-VL image processor configured for tiny images. No real small
    vision model installs offline."""
    from mlxgw.bench.serving.random_vlm import PROCESSOR, qwen2_vl_config, write_tokenizer, write_weights

    dest.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(dest, tokenizer_source)
    processor = {**PROCESSOR, "min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}
    (dest / "preprocessor_config.json").write_text(json.dumps(processor))
    # Videos: a budget for all frames together large enough that a 56x56 clip keeps its size,
    # so its token count grows with the frames sampled (2 frames of 56x56: 4 tokens).
    video = {**processor, "min_pixels": 28 * 28 * 2, "max_pixels": 56 * 56 * 64}
    (dest / "video_preprocessor_config.json").write_text(json.dumps(video))
    config = qwen2_vl_config("tiny", ids, eos=[ids["<|im_end|>"], 0])
    (dest / "config.json").write_text(json.dumps(config))
    write_weights(dest, config, seed)
    return dest
