"""A random-weight Qwen2-VL written into a folder, at the size of the real Qwen2-VL-2B or tiny,
so a benchmark of video turns measures a vision encoder and a language model of real size
without downloading weights (none can be fetched here). Timing does not depend on trained
weights: the same matrices are multiplied whatever their values.

The tokenizer is a local one (SmolLM2's by default, from `mlxgw pull`) with Qwen2-VL's vision
tokens added, and the vocabulary is that tokenizer's (49,156 ids where Qwen2-VL has 151,936:
only the output projection of the last position is smaller, a few milliseconds of a first
token). The processor is mlx-vlm's own Qwen2-VL processor.

    python -m mlxgw.bench.serving.random_vlm DEST [--size 2b|tiny] [--dtype float32|bfloat16|float16]

float32 by default: on a CPU (this project's Linux hosts) MLX multiplies bfloat16 matrices at
3.3 GFLOPS where float32 runs at 52 (OpenBLAS, 2 cores, measured); on a Mac's GPU bfloat16
is the realistic choice.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_TOKENIZER = Path("~/.cache/mlxgw/models/smollm2-135m").expanduser()
SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% else %}{% for part in message.content %}"
    "{% if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part.type == 'video' %}<|vision_start|><|video_pad|><|vision_end|>{% else %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2-VL-2B-Instruct's config.json (its language model and vision tower), and the tests' tiny one.
SIZES = {
    "2b": {
        "text": {
            "hidden_size": 1536,
            "num_hidden_layers": 28,
            "intermediate_size": 8960,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 32768,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        },
        "vision": {"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "num_heads": 16, "mlp_ratio": 4},
    },
    "tiny": {
        "text": {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        },
        "vision": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2},
    },
}
PROCESSOR = {
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280,
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def write_tokenizer(dest: Path, source: Path) -> dict[str, int]:
    """source's tokenizer with the vision tokens and the template, saved into dest; the ids
    the config names (and the vocabulary's size under "vocab")."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json"))
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    tok.chat_template = TEMPLATE
    tok.save_pretrained(dest)
    (dest / "chat_template.jinja").write_text(TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in [*SPECIALS, "<|im_end|>"]}
    ids["vocab"] = len(tok)
    return ids


def qwen2_vl_config(size: str, ids: dict[str, int], dtype: str | None = None, eos: list[int] | None = None) -> dict:
    """The config.json of a SIZES model (dtype: its torch_dtype, none named when None; eos: the
    stop ids, <|im_end|> alone by default)."""
    spec = SIZES[size]
    return {
        "model_type": "qwen2_vl",
        "architectures": ["Qwen2VLForConditionalGeneration"],
        **({"torch_dtype": dtype} if dtype else {}),
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": eos or [ids["<|im_end|>"]],
        "vocab_size": ids["vocab"],
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        **spec["text"],
        "vision_config": {
            **spec["vision"],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
    }


def build(dest: Path, size: str = "2b", dtype: str = "float32", tokenizer: Path = DEFAULT_TOKENIZER) -> Path:
    """Write the model into dest (kept when it was built before at the same size and dtype: a
    2B build is 2.2 billion parameters, 8.8 GB in float32, 4.4 GB in bfloat16)."""
    marker = dest / "random_vlm.json"
    wanted = {"size": size, "dtype": dtype}
    if marker.exists() and json.loads(marker.read_text()) == wanted and (dest / "model.safetensors").exists():
        return dest
    if not (tokenizer / "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer.json in {tokenizer}: `mlxgw pull smollm2-135m` or --tokenizer DIR")
    dest.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(dest, tokenizer)
    config = qwen2_vl_config(size, ids, dtype)
    (dest / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    # Videos: a pixel budget for all frames together that keeps a 224x224 clip of 64 frames whole.
    (dest / "video_preprocessor_config.json").write_text(json.dumps({**PROCESSOR, "max_pixels": 224 * 224 * 64}))
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    write_weights(dest, config, dtype=dtype)
    marker.write_text(json.dumps(wanted))
    return dest


def write_weights(dest: Path, config: dict, seed: int = 0, dtype: str | None = None) -> None:
    """Random weights of mlx-vlm's model for config, into dest/model.safetensors (dtype: cast
    to it; None keeps MLX's float32)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args

    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(dict(config))
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    model_config.text_config = module.TextConfig.from_dict({k: v for k, v in config.items() if k != "vision_config"})
    mx.random.seed(seed)
    model = module.Model(model_config)
    if dtype:
        model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="2b")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="float32")
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    args = ap.parse_args()
    print(build(args.dest, args.size, args.dtype, args.tokenizer))


if __name__ == "__main__":
    main()
