"""A tiny random-weight image model the tests build themselves: mlx-vlm's own Z-Image classes
(the diffusion transformer, its Qwen3 text encoder, the VAE) at toy sizes, saved as a
Diffusers-layout folder that `mlx_vlm.generate.image` recognises, with SmolLM2's tokenizer.
Z-Image is the family whose every size comes from its config files (FLUX.2 fixes its 4B/9B
shapes in code) and which both generates and edits: a 64x48 image takes well under a second
on CPU. No real image model installs offline."""

from __future__ import annotations

import json
from pathlib import Path

# A chat template with no system turn: Z-Image formats the prompt as one user message.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_image_model(dest: Path, tokenizer_source: Path, seed: int = 0) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models.z_image.config import ZImageTextEncoderConfig, ZImageTransformerConfig, ZImageVAEConfig
    from mlx_vlm.models.z_image.text_encoder import ZImageTextEncoder
    from mlx_vlm.models.z_image.transformer import ZImageTransformer
    from mlx_vlm.models.z_image.vae import ZImageVAE
    from transformers import PreTrainedTokenizerFast

    dest.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_source / "tokenizer.json"))
    tok.pad_token, tok.chat_template = "<|endoftext|>", TEMPLATE
    tok.save_pretrained(dest / "tokenizer")
    # Diffusers' key names, as the real checkpoints' config.json files have them.
    transformer = {
        "dim": 64, "n_heads": 2, "n_kv_heads": 2, "intermediate_size": 128, "in_channels": 16,
        "cap_feat_dim": 64, "n_layers": 1, "n_refiner_layers": 1, "all_patch_size": [2],
        "all_f_patch_size": [1], "axes_dims": [8, 12, 12], "adaln_embed_dim": 64,
    }  # fmt: skip
    text = {
        "vocab_size": len(tok), "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 128, "head_dim": 32, "max_position_embeddings": 4096,
    }  # fmt: skip
    # Four blocks: the pipeline assumes the VAE's factor of 8; 32 channels: its group norms.
    vae = {"latent_channels": 16, "block_out_channels": [32, 32, 32, 32], "layers_per_block": 1}
    mx.random.seed(seed)
    parts = {
        "transformer": (transformer, ZImageTransformer(ZImageTransformerConfig.from_dict(transformer))),
        "text_encoder": (text, ZImageTextEncoder(ZImageTextEncoderConfig.from_dict(text))),
        "vae": (vae, ZImageVAE(ZImageVAEConfig.from_dict(vae))),
    }
    for name, (config, module) in parts.items():
        folder = dest / name
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        weights = {k: v for k, v in tree_flatten(module.parameters()) if "rotary" not in k}
        mx.save_safetensors(str(folder / "model.safetensors"), weights)
        # mlx_vlm_format: the weights are in MLX's layout already (no transpose on load).
        index = {"metadata": {"mlx_vlm_format": "z_image"}, "weight_map": dict.fromkeys(weights, "model.safetensors")}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (dest / "scheduler").mkdir(exist_ok=True)
    (dest / "scheduler" / "scheduler_config.json").write_text(json.dumps({"shift": 3.0}))
    (dest / "model_index.json").write_text(json.dumps({"_class_name": "ZImagePipeline"}))
    return dest
