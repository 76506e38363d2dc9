"""LoRA adapters for tests, written exactly as `mlx_lm.lora` writes its output folder.

mlx-lm's own tuner wraps the model's layers (`linear_to_lora_layers`, as `mlx_lm.lora`
does before training); instead of training, the low-rank weights are set to random non-zero
values, which changes the outputs as much as training would and takes no time. The folder
holds `adapters.safetensors` (the trainable parameters, as mlx_lm.lora saves them) and
`adapter_config.json` (its arguments: fine_tune_type, num_layers, lora_parameters), so
`mlx_lm.load(base, adapter_path=folder)` loads it as it loads a trained one."""

from __future__ import annotations

import json
from pathlib import Path


def write_lora_adapter(
    base: Path, dest: Path, seed: int, keys: list[str] | None = None, rank: int = 4, scale: float = 4.0
) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.lora import LoRALinear, LoRASwitchLinear
    from mlx_lm.tuner.utils import linear_to_lora_layers

    if (dest / "adapters.safetensors").exists():
        return dest
    model, _ = load(str(base))
    model.freeze()  # as mlx_lm.lora: only the LoRA weights are trainable, and saved
    params: dict = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        params["keys"] = keys
    num_layers = len(model.layers)
    mx.random.seed(seed)
    linear_to_lora_layers(model, num_layers, params)
    for _, module in model.named_modules():
        if isinstance(module, (LoRALinear, LoRASwitchLinear)):  # trained LoRA has a non-zero B (it starts at zero)
            module.lora_b = 0.5 * mx.random.normal(module.lora_b.shape)
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    config = {
        "model": str(base),
        "fine_tune_type": "lora",
        "num_layers": num_layers,
        "lora_parameters": params,
        "batch_size": 1,
        "iters": 1,
        "learning_rate": 1e-5,
        "seed": seed,
        "adapter_path": str(dest),
    }
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=4))
    return dest
