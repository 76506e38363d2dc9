"""A text encoder loaded from a Hugging Face / sentence-transformers folder.

It turns inputs into token ids (validating length), and batches of ids into vectors or,
for cross-encoders, relevance scores: one forward pass per call, padded to the longest
input of the batch. Pooling and normalisation follow the folder's sentence-transformers
modules (1_Pooling, 2_Normalize), so vectors match what sentence-transformers returns."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ....shared.errors import invalid

SUPPORTED = ("bert", "roberta", "xlm-roberta")


def is_cross_encoder(cfg: dict) -> bool:
    """A sequence classifier (BertForSequenceClassification, ...): scores pairs, no vectors."""
    return any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or [])


def _read_json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class TextEncoder:
    def __init__(self, path: Path, *, max_length: int | None = None, truncate: bool = False):
        import mlx.core as mx
        from tokenizers import Tokenizer

        self._mx = mx
        cfg = _read_json(path / "config.json")
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: no readable config.json")
        self.cross_encoder = is_cross_encoder(cfg)
        self._load_model(path, cfg)

        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.vocab_size = int(cfg["vocab_size"])
        self.type_vocab_size = int(cfg.get("type_vocab_size") or 1)
        self.pad_id = int(cfg.get("pad_token_id") or 0)
        self.prefix, self.suffix = self._special_tokens()

        st_config = _read_json(path / "sentence_bert_config.json") or {}
        limit = int(cfg.get("max_position_embeddings", 512))
        if isinstance(st_config, dict) and st_config.get("max_seq_length"):
            limit = min(limit, int(st_config["max_seq_length"]))
        self.context_length = min(max_length, limit) if max_length else limit
        self.truncate = truncate
        self.dim = int(cfg["hidden_size"])
        pooling = _read_json(path / "1_Pooling" / "config.json") or {}
        self.pooling = "mean"
        if pooling.get("pooling_mode_cls_token"):
            self.pooling = "cls"
        elif pooling.get("pooling_mode_max_tokens"):
            self.pooling = "max"
        modules = _read_json(path / "modules.json") or []
        self.normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules if isinstance(m, dict))
        self.forward_passes = 0
        self.inputs_encoded = 0

    def _load_model(self, path: Path, cfg: dict) -> None:
        from . import bert

        mx = self._mx
        if cfg.get("model_type") not in SUPPORTED:
            raise ValueError(
                f"{path}: encoder type {cfg.get('model_type')!r} is not supported by the built-in encoder "
                f"({', '.join(SUPPORTED)}); set `engine: mlx-embeddings` on the model to run it with mlx-embeddings"
            )
        self.model = bert.build(cfg, self.cross_encoder)
        weights = {}
        for f in sorted(path.glob("*.safetensors")):
            weights.update(mx.load(str(f)))
        if not weights:
            raise ValueError(f"{path}: no .safetensors weights")
        # strict: a missing or unexpected tensor is an error, never silently random weights
        self.model.load_weights(list(bert.sanitize(weights, self.cross_encoder).items()), strict=True)
        self.model.eval()
        mx.eval(self.model.parameters())

    def _pooled(self, ids, mask):
        """One vector per row, pooled as the folder's 1_Pooling says (before normalisation)."""
        mx = self._mx
        hidden = self.model(ids, mask)
        m = mask[:, :, None].astype(hidden.dtype)
        if self.pooling == "cls":
            return hidden[:, 0]
        if self.pooling == "max":
            return mx.where(m > 0, hidden, -mx.inf).max(axis=1)
        return (hidden * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1)

    def _special_tokens(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer wraps every text in ([CLS] ... [SEP] for BERT), so token-id
        inputs get the same framing as text."""
        full = self.tokenizer.encode("a").ids
        bare = self.tokenizer.encode("a", add_special_tokens=False).ids
        for i in range(len(full) - len(bare) + 1):
            if full[i : i + len(bare)] == bare:
                return full[:i], full[i + len(bare) :]
        return [], []

    # -- inputs -----------------------------------------------------------------------------
    def tokenize(self, item: str | list[int], index: int, truncate: bool | None = None) -> list[int]:
        if isinstance(item, str):
            ids = self.tokenizer.encode(item).ids
        else:
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in item):
                raise invalid(f"input[{index}]: token ids must be integers in [0, {self.vocab_size})", "input")
            ids = self.prefix + list(item) + self.suffix
        return self._fit(ids, index, self.truncate if truncate is None else truncate)

    def _fit(self, ids: list[int], index: int, truncate: bool) -> list[int]:
        if len(ids) <= self.context_length:
            return ids
        if not truncate:
            raise invalid(
                f"input[{index}] has {len(ids)} tokens; this model's limit is {self.context_length} tokens. "
                "Shorten the input (or set truncate: true on the model).",
                "input",
            )
        return ids[: self.context_length - len(self.suffix)] + self.suffix

    def tokenize_pair(self, query: str, document: str) -> tuple[list[int], list[int]]:
        """Cross-encoder input: [CLS] query [SEP] document [SEP]; long documents are cut."""
        enc = self.tokenizer.encode(query, document)
        ids = list(enc.ids)
        # RoBERTa models have one token type; a tokenizer that marks the second segment 1
        # would index past the table (MLX does not bounds-check: garbage scores, even NaN).
        types = [min(t, self.type_vocab_size - 1) for t in enc.type_ids]
        if len(ids) > self.context_length:
            q_len = len(self.tokenizer.encode(query).ids)
            if q_len >= self.context_length // 2:
                raise invalid(f"the query has {q_len} tokens; this model's limit is {self.context_length}", "query")
            keep = self.context_length - len(self.suffix)
            ids, types = ids[:keep] + self.suffix, types[:keep] + types[-len(self.suffix) :]
        return ids, types

    # -- forward passes ----------------------------------------------------------------------
    def _pad(self, batch: list[list[int]], fill: int):
        mx = self._mx
        width = max(len(b) for b in batch)
        rows = np.full((len(batch), width), fill, dtype=np.int32)
        mask = np.zeros((len(batch), width), dtype=np.int32)
        for i, ids in enumerate(batch):
            rows[i, : len(ids)] = ids
            mask[i, : len(ids)] = 1
        return mx.array(rows), mx.array(mask)

    def embed(self, batch: list[list[int]], dimensions: list[int | None] | None = None) -> list[np.ndarray]:
        """One vector (float32) per input, pooled and normalised as the model specifies;
        `dimensions` truncates a vector and renormalises it."""
        mx = self._mx
        ids, mask = self._pad(batch, self.pad_id)
        pooled = self._pooled(ids, mask)
        if self.normalize:
            pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        vectors = np.array(pooled.astype(mx.float32))
        self.forward_passes += 1
        self.inputs_encoded += len(batch)
        out = []
        for i, vec in enumerate(vectors):
            d = dimensions[i] if dimensions else None
            if d:
                vec = vec[:d]
                vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
            out.append(np.ascontiguousarray(vec, dtype=np.float32))
        return out

    def score(self, batch: list[tuple[list[int], list[int]]]) -> list[float]:
        """Cross-encoder relevance in [0, 1]: the sigmoid of the single logit
        (sentence-transformers' CrossEncoder default for one label)."""
        mx = self._mx
        ids, mask = self._pad([b[0] for b in batch], self.pad_id)
        types, _ = self._pad([b[1] for b in batch], 0)
        logits = self.model(ids, mask, types)[:, 0]
        scores = np.array(mx.sigmoid(logits.astype(mx.float32)))
        self.forward_passes += 1
        self.inputs_encoded += len(batch)
        return [float(s) for s in scores]

    # -- what the engine asks every runner ------------------------------------------------
    def stats(self) -> dict:
        mx = self._mx
        return {
            "forward_passes": self.forward_passes,
            "inputs_encoded": self.inputs_encoded,
            "mlx_active_bytes": int(mx.get_active_memory()),
            "mlx_peak_bytes": int(mx.get_peak_memory()),
        }

    def cache_stats(self) -> dict:
        return {}

    def cache_clear(self) -> None:
        return None

    def encode(self, req) -> list[int]:
        raise invalid("token counting is for chat models", "model")


class MlxEmbeddingsEncoder(TextEncoder):
    """Encoders the built-in one does not implement (ModernBERT, Qwen3 and Gemma embedding
    models, ...), run by mlx-embeddings (`engine: mlx-embeddings`, needs
    `pip install 'mlxgw[embeddings]'`). Tokenizing, batching, limits and `dimensions` are the
    same as for the built-in encoder; the model and its pooling are mlx-embeddings'."""

    def _load_model(self, path: Path, cfg: dict) -> None:
        if self.cross_encoder:
            raise ValueError(f"{path}: cross-encoders run on the built-in encoder (engine: mlx), not mlx-embeddings")
        try:
            from mlx_embeddings.utils import load_model
        except ImportError as e:
            raise RuntimeError(f"engine mlx-embeddings needs pip install 'mlxgw[embeddings]': {e}") from None
        self.model = load_model(path)
        self.model.eval()

    def _pooled(self, ids, mask):
        return self.model(ids, attention_mask=mask).text_embeds
