"""Word-level timestamps, as openai/whisper's timing.py computes them: the cross-attention of
the model's alignment heads over the decoded text, normalised and median-filtered, aligned
to the audio frames by dynamic time warping; a word starts and ends where the path moves
on to its first and past its last token."""

from __future__ import annotations

import string

import mlx.core as mx
import numpy as np

from .tokenizer import WhisperTokens

TOKENS_PER_SECOND = 50  # encoder positions: 20 ms each
MEDIAN_FILTER_WIDTH = 7


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cheapest monotonic path through cost (rows, cols) from (0, 0) to the far corner."""
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0
    trace = np.zeros((n + 1, m + 1), np.int8)
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            options = (acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1])
            k = int(np.argmin(options))
            acc[i, j] = cost[i - 1, j - 1] + options[k]
            trace[i, j] = k
    i, j, rows, cols = n, m, [], []
    while i > 0 and j > 0:
        rows.append(i - 1)
        cols.append(j - 1)
        k = trace[i, j]
        i, j = (i - 1, j - 1) if k == 0 else (i - 1, j) if k == 1 else (i, j - 1)
    return np.array(rows[::-1]), np.array(cols[::-1])


def median_filter(x: np.ndarray, width: int) -> np.ndarray:
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1)
    return np.median(windows, axis=-1)


def split_words(tok: WhisperTokens, tokens: list[int]) -> list[tuple[str, list[int]]]:
    """Tokens grouped into words: a word starts at a leading space or a punctuation mark
    (whole UTF-8 characters first: one character can span several tokens)."""
    pieces: list[tuple[str, list[int]]] = []
    current: list[int] = []
    for t in tokens:
        current.append(t)
        text = tok.decode(current)
        if "\ufffd" not in text:
            pieces.append((text, current))
            current = []
    words: list[tuple[str, list[int]]] = []
    for text, ids in pieces:
        if not words or text.startswith(" ") or text.strip() in string.punctuation:
            words.append((text, list(ids)))
        else:
            words[-1] = (words[-1][0] + text, words[-1][1] + ids)
    return words


def word_timestamps(
    model,
    tok: WhisperTokens,
    features: mx.array,
    sot_sequence: list[int],
    text_tokens: list[int],
    n_samples: int,
    offset_s: float,
) -> list[dict]:
    """[{word, start, end}] for one window's text, in seconds from the start of the audio."""
    if not text_tokens or not tok.alignment_heads:
        return []
    seq = [*sot_sequence, tok.no_timestamps, *text_tokens, tok.eot]
    frames = max(1, min(features.shape[1], n_samples // 320))
    scores = model.decoder.cross_attention_scores(seq, features, tok.alignment_heads)
    w = np.array(mx.softmax(scores[:, :, :frames], axis=-1))
    w = (w - w.mean(axis=-2, keepdims=True)) / (w.std(axis=-2, keepdims=True) + 1e-9)
    matrix = median_filter(w, MEDIAN_FILTER_WIDTH).mean(axis=0)[len(sot_sequence) : -1]
    text_idx, time_idx = dtw(-matrix)
    words = split_words(tok, text_tokens + [tok.eot])
    bounds = np.cumsum([0] + [len(ids) for _, ids in words[:-1]])
    jumps = np.pad(np.diff(text_idx), (1, 0), constant_values=1).astype(bool)
    jump_times = time_idx[jumps] / TOKENS_PER_SECOND
    out = []
    for k, (text, _) in enumerate(words[:-1]):
        start = float(jump_times[min(bounds[k], len(jump_times) - 1)])
        end = float(jump_times[min(bounds[k + 1], len(jump_times) - 1)])
        if text.strip() and text.strip() not in string.punctuation:  # OpenAI lists words only
            out.append({"word": text.strip(), "start": round(offset_s + start, 3), "end": round(offset_s + end, 3)})
    return out
