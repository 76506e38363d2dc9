"""What the worker needs to know about a loaded mlx-lm model, whatever its family's layout.

mlx-lm's model classes do not agree on where their hyper-parameters live: most keep a flat
`args.vocab_size`, Qwen3.5 / Qwen3.5-MoE and the multimodal Gemma 3/4 folders nest the text
model's arguments in `text_config` (a dict or a dataclass), and some have no vocabulary size
attribute at all. The logits' width is what native code must be told (logit_bias ids,
top_k), so it is taken from the first source that has it: the output head's rows, the
token embedding's rows (a tied head), the args or their nested text args, and last the
tokenizer. Quantized layers keep one row per token too (their packing is along columns)."""

from __future__ import annotations

from typing import Any


class UnservableModel(RuntimeError):
    """A model mlx-lm loaded but mlxgw cannot serve; the message names what is missing."""


def _field(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _nested_args(model) -> list[Any]:
    """The model's own args, then its text model's (flat or under text_config / language_model)."""
    out = []
    for holder in (model, getattr(model, "language_model", None), getattr(model, "model", None)):
        args = getattr(holder, "args", None)
        if args is not None:
            out.append(args)
            out.append(_field(args, "text_config"))
    return [a for a in out if a is not None]


def model_arg(model, name: str) -> int | None:
    """A positive integer hyper-parameter (hidden_size, num_attention_heads...) from the
    model's args or its nested text args; None where none says it."""
    for args in _nested_args(model):
        value = _field(args, name)
        if isinstance(value, int) and value > 0:
            return value
    return None


# What families name their token embedding (a tied head is one of these).
TOKEN_EMBEDDINGS = ("embed_tokens", "wte", "tok_embeddings", "embeddings", "embedding")


def _head_rows(model) -> int | None:
    """Rows of the output head, else of the token embedding (a tied head). Only modules named
    as such count: Gemma 4 also has per-layer embeddings of another vocabulary."""
    candidates = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or weight.ndim != 2:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "lm_head":
            candidates.append((0, weight.shape[0]))
        elif leaf in TOKEN_EMBEDDINGS:
            candidates.append((1, weight.shape[0]))
    return min(candidates)[1] if candidates else None


def vocab_size(model, tokenizer) -> int:
    """The width of the model's logits."""
    rows = _head_rows(model)
    if rows:
        return int(rows)
    for args in _nested_args(model):
        value = _field(args, "vocab_size")
        if isinstance(value, int) and value > 0:
            return value
    size = getattr(tokenizer, "vocab_size", None) or (len(tokenizer) if hasattr(tokenizer, "__len__") else None)
    if size:
        return int(size)
    raise UnservableModel("its vocabulary size: no vocab_size in its config, no token embedding, no tokenizer size")


def context_length(config: dict, default: int = 4096) -> int:
    """max_position_embeddings from the config, or from its text_config (Qwen3.5, Gemma 3/4)."""
    for source in (config, config.get("text_config") or {}):
        value = source.get("max_position_embeddings") if isinstance(source, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return default


def check_servable(model) -> None:
    """Fail the load once, with a message, for what the engine needs and the model lacks."""
    if not hasattr(model, "make_cache") and not hasattr(model, "layers"):
        raise UnservableModel(f"{type(model).__module__}: no make_cache() and no layers to build a KV cache for")
