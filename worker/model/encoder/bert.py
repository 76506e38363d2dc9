"""BERT-family encoders in MLX: BERT (MiniLM, BGE, E5, GTE and the other sentence-transformers
models built on it) and (XLM-)RoBERTa (multilingual E5, BGE-M3, bge-reranker), which differ
only in their position ids and classification head.

Why our own module instead of mlx-embeddings: mlx-embeddings 0.1.0 imports mlx-vlm at
module load, and mlx-vlm pulls opencv, datasets, mlx-audio and a web stack (about 1 GB):
too much for a 22M-parameter encoder every install serves by default. The module keeps
Hugging Face's parameter names, so checkpoints load without renaming."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

ROBERTA_TYPES = ("roberta", "xlm-roberta")


class Embeddings(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], h)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], h)
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), h)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.get("layer_norm_eps", 1e-12))
        # RoBERTa numbers positions from pad_token_id + 1 and gives padding pad_token_id.
        self.pad_position = int(cfg.get("pad_token_id", 1)) if cfg.get("model_type") in ROBERTA_TYPES else None

    def __call__(self, ids: mx.array, token_types: mx.array, mask: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1])[None, :]
        if self.pad_position is not None:
            positions = mx.where(mask.astype(mx.bool_), positions + self.pad_position + 1, self.pad_position)
        x = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings(token_types)
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)


class Dense(nn.Module):
    """A projection followed by the residual LayerNorm (BERT's 'output' blocks)."""

    def __init__(self, d_in: int, d_out: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, h: int, eps: float):
        super().__init__()
        self.self = SelfAttention(h)
        self.output = Dense(h, h, eps)


# erf as a rational function of x (Eigen's float erf coefficients, accurate to a few ulp).
# MLX's CPU backend evaluates mx.erf one element at a time (about 25 ns each here), which
# made GELU half of a BERT forward pass; this is multiply-adds only, 3.4x faster, and
# agrees with mx.erf to 5e-7.
_ERF_CLAMP = 3.832506856900711
_ERF_P = (1.128379143519084, 0.18520832239976145, 0.050955695062380861, 0.0034082910107109506, 0.00022905065861350646)
_ERF_Q = (
    1.0,
    0.49746925110067538,
    0.11098505178285362,
    0.014070470171167667,
    0.0010179625278914885,
    0.000023547966471313185,
    -1.1791602954361697e-7,
)


def _poly(x2: mx.array, coefficients: tuple[float, ...]) -> mx.array:
    acc = coefficients[-1] * x2 + coefficients[-2]
    for c in reversed(coefficients[:-2]):
        acc = acc * x2 + c
    return acc


def erf(x: mx.array) -> mx.array:
    x = mx.clip(x, -_ERF_CLAMP, _ERF_CLAMP)
    x2 = x * x
    return x * _poly(x2, _ERF_P) / _poly(x2, _ERF_Q)


def gelu(x: mx.array) -> mx.array:
    """Exact (erf) GELU, BERT's "gelu"."""
    return 0.5 * x * (1.0 + erf(x * 0.7071067811865476))


class Intermediate(nn.Module):
    def __init__(self, h: int, inner: int):
        super().__init__()
        self.dense = nn.Linear(h, inner)

    def __call__(self, x: mx.array) -> mx.array:
        return gelu(self.dense(x))


class Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-12)
        self.heads = cfg["num_attention_heads"]
        self.attention = Attention(h, eps)
        self.intermediate = Intermediate(h, cfg["intermediate_size"])
        self.output = Dense(cfg["intermediate_size"], h, eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, n, h = x.shape
        att = self.attention.self

        def heads(t: mx.array) -> mx.array:
            return t.reshape(b, n, self.heads, h // self.heads).transpose(0, 2, 1, 3)

        q, k, v = heads(att.query(x)), heads(att.key(x)), heads(att.value(x))
        ctx = mx.fast.scaled_dot_product_attention(q, k, v, scale=(h // self.heads) ** -0.5, mask=mask)
        ctx = ctx.transpose(0, 2, 1, 3).reshape(b, n, h)
        x = self.attention.output(ctx, x)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.layer = [Layer(cfg) for _ in range(cfg["num_hidden_layers"])]


class Pooler(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.dense = nn.Linear(h, h)

    def __call__(self, hidden: mx.array) -> mx.array:
        return mx.tanh(self.dense(hidden[:, 0]))


class BertModel(nn.Module):
    def __init__(self, cfg: dict, with_pooler: bool = False):
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        if with_pooler:
            self.pooler = Pooler(cfg["hidden_size"])

    def __call__(self, ids: mx.array, attention_mask: mx.array, token_types: mx.array | None = None) -> mx.array:
        """Last hidden states (batch, length, hidden); padding positions are masked out of attention."""
        if token_types is None:
            token_types = mx.zeros_like(ids)
        x = self.embeddings(ids, token_types, attention_mask)
        # Additive mask over keys, broadcast over heads and queries.
        mask = mx.where(attention_mask[:, None, None, :].astype(mx.bool_), 0.0, -1e9).astype(x.dtype)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x


def _labels(cfg: dict) -> int:
    return cfg.get("num_labels") or len(cfg.get("id2label") or [0])


class BertCrossEncoder(nn.Module):
    """BertForSequenceClassification: a relevance score per (query, document) pair."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.bert = BertModel(cfg, with_pooler=True)
        self.classifier = nn.Linear(cfg["hidden_size"], _labels(cfg))

    def __call__(self, ids: mx.array, attention_mask: mx.array, token_types: mx.array) -> mx.array:
        hidden = self.bert(ids, attention_mask, token_types)
        return self.classifier(self.bert.pooler(hidden))


class RobertaHead(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.dense = nn.Linear(cfg["hidden_size"], cfg["hidden_size"])
        self.out_proj = nn.Linear(cfg["hidden_size"], _labels(cfg))

    def __call__(self, first_token: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(first_token)))


class RobertaCrossEncoder(nn.Module):
    """(XLM-)RobertaForSequenceClassification (bge-reranker): no pooler, a two-layer head on <s>."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.roberta = BertModel(cfg)
        self.classifier = RobertaHead(cfg)

    def __call__(self, ids: mx.array, attention_mask: mx.array, token_types: mx.array) -> mx.array:
        return self.classifier(self.roberta(ids, attention_mask, token_types)[:, 0])


def build(cfg: dict, cross_encoder: bool) -> nn.Module:
    if not cross_encoder:
        return BertModel(cfg)
    return RobertaCrossEncoder(cfg) if cfg.get("model_type") in ROBERTA_TYPES else BertCrossEncoder(cfg)


def sanitize(weights: dict[str, mx.array], cross_encoder: bool) -> dict[str, mx.array]:
    """Drop buffers and pretraining heads Hugging Face stores with the weights; align the
    'bert.' / 'roberta.' prefix with the module."""
    out = {}
    for name, w in weights.items():
        if name.endswith("position_ids") or name.startswith(("cls.", "lm_head.")):
            continue
        if not cross_encoder:
            name = name.removeprefix("bert.").removeprefix("roberta.")
            if name.startswith("pooler."):
                continue  # unused for embeddings
        out[name] = w
    return out
