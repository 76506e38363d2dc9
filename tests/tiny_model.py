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


def build_tiny_model(dest: Path, tokenizer_source: Path, seed: int = 0) -> Path:
    """Write a tiny llama into dest, with the tokenizer files of tokenizer_source."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, save_config, save_model

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_source / name, dest / name)
    source_config = json.loads((tokenizer_source / "config.json").read_text())
    config = dict(
        TINY_CONFIG,
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
    "architectures": ["BertForSequenceClassification"],
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


def build_tiny_cross_encoder(dest: Path, tokenizer_source: Path, seed: int = 0) -> Path:
    """A random-weight BERT cross-encoder (BertForSequenceClassification) with a real
    WordPiece tokenizer: exercises the reranking path without a real reranker."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from worker.embedding.bert import BertCrossEncoder

    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_source / "tokenizer.json", dest / "tokenizer.json")
    source_config = json.loads((tokenizer_source / "config.json").read_text())
    config = dict(TINY_BERT, vocab_size=source_config["vocab_size"])
    mx.random.seed(seed)
    model = BertCrossEncoder(config)
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (dest / "config.json").write_text(json.dumps(config))
    return dest
