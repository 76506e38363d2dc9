"""An adapter folder's layout and config, without MLX (the gateway checks a folder with it
before a worker loads the weights: worker/model/adapters/formats.py).

- mlx_lm.lora's output: adapters.safetensors and adapter_config.json (fine_tune_type,
  lora_parameters.scale).
- A Hugging Face PEFT LoRA folder: adapter_model.safetensors and adapter_config.json
  (peft_type LORA, r, lora_alpha, use_rslora); its scale is lora_alpha / r (rsLoRA:
  lora_alpha / sqrt(r)).

ValueError says what is wrong in words a user can act on."""

from __future__ import annotations

import json
import math
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
MLX_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"


def weights_file(folder: Path) -> Path:
    """The folder's weights: PEFT's when it has them, else mlx_lm.lora's."""
    return folder / (PEFT_WEIGHTS if (folder / PEFT_WEIGHTS).is_file() else MLX_WEIGHTS)


def read_config(folder: Path) -> tuple[bool, dict]:
    """(whether it is a PEFT folder, its adapter_config.json)."""
    config_path, weights = folder / CONFIG_FILE, weights_file(folder)
    if not config_path.is_file() or not weights.is_file():
        raise ValueError(
            f"{folder} is not an adapter folder: it needs {CONFIG_FILE} and {MLX_WEIGHTS} (mlx_lm.lora) "
            f"or {PEFT_WEIGHTS} (PEFT)"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{CONFIG_FILE} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FILE} is not a JSON object")
    return weights.name == PEFT_WEIGHTS, config


def scale_of(peft: bool, config: dict) -> float:
    """The adapter's scale: a finite number (NaN or infinity would end every answer of its
    rows in NaN), from a positive rank for PEFT (r: 0 divides by zero)."""
    try:
        if not peft:
            kind = config.get("fine_tune_type", "lora")
            if kind != "lora":
                raise ValueError(f"fine_tune_type {kind!r}: only LoRA adapters are served (fuse it with mlx_lm.fuse)")
            return _finite(config["lora_parameters"]["scale"], "lora_parameters.scale")
        _check_peft(config)
        rank = _finite(config["r"], "r")
        if rank <= 0:
            raise ValueError(f"{CONFIG_FILE}: 'r' must be a positive rank, got {config['r']!r}")
        alpha = _finite(config.get("lora_alpha", config["r"]), "lora_alpha")
        return _finite(alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank, "lora_alpha / r")
    except (KeyError, TypeError, AttributeError) as e:
        what = "r and lora_alpha" if peft else "lora_parameters.scale"
        raise ValueError(f"{CONFIG_FILE} has no readable {what} ({type(e).__name__}: {e})") from None


def _finite(value, field: str) -> float:
    """A number of the config (JSON allows NaN and Infinity as Python writes them; a bool is no number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{CONFIG_FILE}: '{field}' must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer past a double's range
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{CONFIG_FILE}: '{field}' must be a finite number, got {value!r}")
    return number


def _check_peft(config: dict) -> None:
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"peft_type {kind!r}: only LoRA adapters are served")
    for flag, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) layers")):
        if config.get(flag):
            raise ValueError(f"{what} adapters are not served")
    if config.get("bias", "none") != "none":
        raise ValueError("adapters that train biases are not served")
    for field in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise ValueError(f"{field} is not served (only one rank and alpha, LoRA layers only)")
