"""A tiny random-weight Gemma 4 with its audio encoder (mlx-vlm's gemma4: a Conformer audio
tower, a vision tower, the language model), SmolLM2's tokenizer plus Gemma 4's media tokens,
and mlx-vlm's own Gemma 4 processor (its numpy mel feature extractor: 16 kHz, one audio
token per 40 ms, at most 750 tokens). No real small audio-reading model installs offline."""

from __future__ import annotations

import json
from pathlib import Path

# Gemma 4's media markers: the processor expands each <|audio|> into
# <|audio> + <|audio|> x ceil(ms / 40) + <audio|> (images and video likewise).
SPECIALS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "video_token": "<|video|>",
}

# ChatML (SmolLM2's own turns) placing each media part's marker.
AUDIO_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% else %}{% for part in message.content %}"
    "{% if part.type == 'image' %}<|image|>{% elif part.type == 'audio' %}<|audio|>"
    "{% elif part.type == 'video' %}<|video|>{% else %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(dest: Path, tokenizer_source: Path) -> dict[str, int]:
    """SmolLM2's tokenizer with Gemma 4's media tokens, named in tokenizer_config.json as Gemma
    4's are (the processor reads tokenizer.audio_token and its id); the ids by token."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_source / "tokenizer.json"))
    tok.add_special_tokens({"additional_special_tokens": list(SPECIALS.values())})
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    tok.chat_template = AUDIO_TEMPLATE
    tok.save_pretrained(dest)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(SPECIALS)
    config_path.write_text(json.dumps(config, indent=1))
    (dest / "chat_template.jinja").write_text(AUDIO_TEMPLATE)
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in SPECIALS.items()}
    ids["im_end"] = tok.convert_tokens_to_ids("<|im_end|>")
    ids["vocab"] = len(tok)
    return ids


def tiny_gemma4_config(ids: dict[str, int], audio: bool = True) -> dict:
    vocab = ids["vocab"]
    text = {
        "model_type": "gemma4_text",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 16,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab,
        "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 4096,
        "use_double_wide_mlp": False,
        "tie_word_embeddings": True,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 16,
        "patch_size": 16,
        "position_embedding_size": 64,
        "pooling_kernel_size": 3,
    }
    audio_config = {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "subsampling_conv_channels": [8, 4],
        "output_proj_dims": 32,
    }
    return {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "audio_config": audio_config if audio else None,
        "vocab_size": vocab,
        "hidden_size": 64,
        "image_token_id": ids["image_token"],
        "boi_token_id": ids["boi_token"],
        "eoi_token_id": ids["eoi_token"],
        "audio_token_id": ids["audio_token"],
        "boa_token_id": ids["boa_token"],
        "eoa_token_id": ids["eoa_token"],
        "video_token_id": ids["video_token"],
        "eos_token_id": [ids["im_end"]],
        "pad_token_id": 0,
    }


def build_tiny_audio_model(dest: Path, tokenizer_source: Path, seed: int = 0, audio: bool = True) -> Path:
    """Write the tiny Gemma 4 into dest (audio=False: the same model without its audio tower,
    as a text-and-image-only checkpoint of an audio family ships)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args

    dest.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer(dest, tokenizer_source)
    config = tiny_gemma4_config(ids, audio)
    processor = {
        "audio_seq_length": 750,
        "audio_ms_per_token": 40,
        "image_processor": {"patch_size": 16, "max_soft_tokens": 70, "pooling_kernel_size": 3},
    }
    (dest / "processor_config.json").write_text(json.dumps(processor))
    (dest / "config.json").write_text(json.dumps(config))
    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(dict(config))
    model_config.text_config = module.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    model_config.audio_config = module.AudioConfig.from_dict(config["audio_config"]) if audio else None
    mx.random.seed(seed)
    model = module.Model(model_config)
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return dest
