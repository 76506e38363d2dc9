"""Per-token log-probabilities, for the sequences that ask for them.

The decode step normalises the processed logits (after the sequence's logits processors:
repetition/presence/frequency penalties, logit_bias, constraint masks) into log-probabilities
for the rows that ask (worker/model/runners/batch_sampler.py: `scores`; mlx-lm's own step normalises every
row); the sampler then applies temperature and top-p/top-k/min-p. Those per-row vectors come
back in every Response. So a sequence that asks costs one log-softmax, one gather and one
top-k over its own row; a sequence that does not ask costs nothing.

Values are therefore the log-softmax of the processed logits at temperature 1 (temperature
and the truncating filters are not applied, as in vLLM's default): at temperature 0 the
distribution actually sampled from is a point mass, and its logprobs would say nothing.

Token strings and bytes follow OpenAI: `bytes` are the token's UTF-8 bytes; `token` is their
text, or `bytes:\\xe2\\x80` for a token that is not whole UTF-8 on its own."""

from __future__ import annotations

import math

import mlx.core as mx

# OpenAI reports tokens a mask made impossible as -9999.0 (JSON has no -Infinity).
IMPOSSIBLE = -9999.0


def _bpe_byte_decoder() -> dict[str, int]:
    from mlx_lm.tokenizer_utils import _byte_decoder

    return _byte_decoder()


class TokenBytes:
    """A token id's bytes and OpenAI-style string, computed on first use and kept."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        detok = type(getattr(tokenizer, "_detokenizer", None)).__name__
        self.kind = "bpe" if detok.startswith("BPE") else "spm" if detok.startswith("SPM") else "naive"
        self._known: dict[int, tuple[str, list[int]]] = {}

    def _bytes(self, token: int) -> bytes:
        if self.kind == "naive":
            return self.tokenizer.decode([token]).encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if piece is None:
            return b""
        if self.kind == "spm":
            if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        decoder = _bpe_byte_decoder()
        if all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
        return piece.encode("utf-8")  # added tokens (<|im_end|>) are stored as plain text

    def get(self, token: int) -> tuple[str, list[int]]:
        known = self._known.get(token)
        if known is None:
            raw = self._bytes(token)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            known = self._known[token] = (text, list(raw))
        return known


def value(x: float) -> float:
    return x if math.isfinite(x) else IMPOSSIBLE


def entries(rows: list[tuple[int, mx.array, int]], names: TokenBytes) -> list[dict]:
    """One entry per (token, log-probability row, number of alternatives): the chosen token's
    logprob and the `top` most likely tokens, as OpenAI's Chat Completions shapes them.
    All rows are evaluated together (one synchronisation per step)."""
    chosen, tops = [], []
    for token, row, top in rows:
        chosen.append(row[token])
        if top > 0:
            ids = mx.argpartition(-row, kth=top - 1)[:top]
            tops.append((ids, row[ids]))
        else:
            tops.append(None)
    mx.eval(chosen, [t for t in tops if t is not None])
    out = []
    for (token, _, _), lp, top in zip(rows, chosen, tops):
        text, raw = names.get(token)
        alternatives = []
        if top is not None:
            ids, values = top[0].tolist(), top[1].tolist()
            for i, v in sorted(zip(ids, values), key=lambda x: -x[1]):
                t, b = names.get(i)
                alternatives.append({"token": t, "bytes": b, "logprob": value(v)})
        out.append({"token": text, "bytes": raw, "logprob": value(lp.item()), "top_logprobs": alternatives})
    return out
