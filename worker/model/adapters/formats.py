"""The two adapter folder layouts the worker reads (shared/adapter_folder.py), as one:
(scale, {layer path: {"lora_a", "lora_b"}}) in mlx-lm's orientation (lora_a: input x rank,
lora_b: rank x output).

- mlx_lm.lora's output: `<layer>.lora_a`, `<layer>.lora_b` as they are.
- A Hugging Face PEFT LoRA folder: `base_model.model.<layer>.lora_A.weight` (rank x input)
  and `lora_B` (output x rank), transposed. Its layer paths are the Transformers module
  names, which are mlx-lm's for the families whose weights load as they are (llama, qwen2,
  ...); a layer mlx-lm names otherwise is refused as not in the model.

ValueError says what is wrong in words a user can act on."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx

from ....shared.adapter_folder import read_config, scale_of, weights_file

LEAVES = ("lora_a", "lora_b")
_PEFT_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])(?:\.default)?\.weight")


def read_pairs(folder: Path) -> tuple[float, dict[str, dict[str, mx.array]]]:
    """The adapter's scale and its low-rank pairs by layer path, in mlx-lm's orientation."""
    peft, config = read_config(folder)
    scale = scale_of(peft, config)
    weights_path = weights_file(folder)
    try:
        weights = mx.load(str(weights_path))
    except Exception as e:  # safetensors' reader raises several kinds for a damaged file
        raise ValueError(f"{weights_path.name} is unreadable ({e})") from None
    pairs: dict[str, dict[str, mx.array]] = {}
    for key, value in weights.items():
        if peft:
            found = _PEFT_KEY.fullmatch(key)
            if found is None:
                raise ValueError(f"tensor {key!r} is not a PEFT LoRA weight")
            path, leaf, value = found[1], "lora_a" if found[2] == "A" else "lora_b", value.T
        else:
            path, _, leaf = key.rpartition(".")
            if leaf not in ("lora_a", "lora_b"):
                raise ValueError(f"tensor {key!r} is not a LoRA weight (DoRA and embedding adapters are not served)")
        pairs.setdefault(path, {})[leaf] = value
    if not pairs:
        raise ValueError(f"{weights_path.name} holds no LoRA weights")
    return scale, pairs


def non_finite(
    scale: float, layers: dict[str, tuple[mx.array, mx.array]], activations: dict[str, mx.Dtype]
) -> str | None:
    """What makes an adapter's arithmetic non-finite before it runs, in words; None if nothing.

    A layer's product runs in the dtype its activations and weights promote to (as mlx-lm's
    LoRALinear: float32 weights on a bfloat16 model run in float32), never narrower than the
    weights' own, so the weights are checked as they are and the scale in that dtype (a scale
    of 1e5 is infinite in float16). Every tensor is reduced in one evaluation."""
    flags = {f"{path}.{leaf}": mx.isfinite(w).all() for path, pair in layers.items() for leaf, w in zip(LEAVES, pair)}
    mx.eval(list(flags.values()))
    bad = [name for name, ok in flags.items() if not ok.item()]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        return f"tensor {bad[0]!r}{more} holds NaN or infinite values"
    for path, (a, b) in layers.items():
        run = (mx.zeros((), activations.get(path, a.dtype)) * mx.zeros((), a.dtype) * mx.zeros((), b.dtype)).dtype
        if not mx.isfinite(mx.array(scale).astype(run)).item():
            return f"its scale {scale!r} is infinite in {run}, the dtype {path} runs in"
    return None
