"""How many sequences a model decodes together when models.yaml does not say (max_num_seqs).

    max_num_seqs = clamp(KV_SHARE_OF_RAM x RAM // (kv_bytes_per_token x TYPICAL_CONTEXT), 1, 64)
    kv_bytes_per_token = layers x kv_heads x head_dim x 2 (keys and values) x dtype bytes

A fixed 8 left throughput flat from 8 concurrent requests on (mlx_lm.server decodes 32 rows)
while a large model's 8 long rows may not fit at all. The KV a row holds is what limits rows
on every machine; compute only makes rows slower, not impossible. TYPICAL_CONTEXT is the
prompt + answer a row holds on average (a chat turn with some history; agents' 8k prompts
are mostly served from the prefix cache, which has its own bound, cache.prefix_memory_mb).
Example: SmolLM2-135M in float32 (30 x 3 x 64 x 2 x 4 = 45 KiB per token, 90 MiB per row)
on a 24 GiB machine: 3 GiB / 90 MiB = 34 rows. This is a cap on the batch's width, not the
memory bound: rows are admitted by the KV they may reach within the budget the worker
measures (worker/model/memory/kv_budget.py). The formula is not raised to MIN_SEQS where it says fewer
(a model with 0.5 MiB per token once got 8 rows where memory held 3); MIN_SEQS is only the
value when the config has no attention shape."""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

KV_SHARE_OF_RAM = 0.125  # live KV of all rows: an eighth of RAM (the prefix cache has 10% more)
TYPICAL_CONTEXT = 2048  # tokens a row holds on average (capped by the model's context)
MIN_SEQS, MAX_SEQS = 8, 64
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class SeqsChoice:
    """What max_num_seqs is and why, as /v1/status reports it."""

    value: int
    source: str  # "models.yaml" or "kv formula"
    kv_bytes_per_token: int | None = None
    kv_budget_bytes: int | None = None
    typical_context: int | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def default_max_num_seqs(kv_bytes_per_token: int, kv_budget_bytes: int, typical_context: int) -> int:
    """The formula above, clamped to [1, MAX_SEQS]."""
    per_row = max(1, kv_bytes_per_token * max(1, typical_context))
    return max(1, min(MAX_SEQS, kv_budget_bytes // per_row))


def kv_bytes_per_token(
    config: dict, dtype_bytes: int, kv_bits: int | None = None, kv_group_size: int = 64
) -> int | None:
    """Keys + values of one token across the layers (None: the config does not say). With
    kv_bits, each element takes kv_bits/8 bytes plus a scale and a bias per group."""
    text = {**config, **(config.get("text_config") or {})}
    layers, heads = text.get("num_hidden_layers"), text.get("num_attention_heads")
    if not layers or not heads:
        return None
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (text.get("hidden_size") or 0) // heads
    if not head_dim:
        return None
    elements = int(layers) * int(kv_heads) * int(head_dim) * 2
    if kv_bits is None:
        return elements * dtype_bytes
    return int(elements * (kv_bits / 8 + 2 * dtype_bytes / kv_group_size))


def activation_dtype_bytes(model_path: Path, config: dict) -> int:
    """Bytes per element of the KV cache: the dtype of the model's floating-point tensors
    (for a quantized model, of its scales), read from the safetensors headers; else the
    config's torch_dtype; else 2."""
    counts: Counter = Counter()
    for file in sorted(model_path.glob("*.safetensors"))[:4]:
        for dtype in _safetensors_dtypes(file):
            if dtype in DTYPE_BYTES:
                counts[dtype] += 1
    if counts:
        return DTYPE_BYTES[counts.most_common(1)[0][0]]
    return DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype")), 2)


def _safetensors_dtypes(file: Path) -> list[str]:
    try:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 64 << 20:
                return []
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error):
        return []
    return [v.get("dtype") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]


def choose_max_num_seqs(
    configured: int | None,
    model_path: Path,
    total_ram_bytes: int,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> SeqsChoice:
    """models.yaml's value when set, else the formula over the model folder's config (with
    the quantized KV's smaller footprint when kv_bits is set)."""
    if configured is not None:
        return SeqsChoice(configured, "models.yaml")
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    dtype_bytes = activation_dtype_bytes(model_path, config)
    per_token = kv_bytes_per_token(config, dtype_bytes, kv_bits, kv_group_size) if config else None
    if per_token is None:
        return SeqsChoice(MIN_SEQS, "kv formula (model config has no attention shape: minimum)")
    text = config.get("text_config") or {}
    model_context = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    context = min(TYPICAL_CONTEXT, int(model_context or TYPICAL_CONTEXT))
    budget = int(total_ram_bytes * KV_SHARE_OF_RAM)
    return SeqsChoice(default_max_num_seqs(per_token, budget, context), "kv formula", per_token, budget, context)
