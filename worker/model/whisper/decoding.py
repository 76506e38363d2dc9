"""Whisper's decoding rules, per row, on one step's logits (numpy): suppressed tokens, the
timestamp grammar, greedy or sampled choice; and how finished tokens become segments.

Follows openai/whisper's decoding.py (SuppressBlank, SuppressTokens, ApplyTimestampRules) and
its temperature fallback thresholds."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

from .tokenizer import WhisperTokens

SECONDS_PER_TIMESTAMP = 0.02
MAX_INITIAL_TIMESTAMP_S = 1.0
COMPRESSION_RATIO_THRESHOLD = 2.4
LOGPROB_THRESHOLD = -1.0
NO_SPEECH_THRESHOLD = 0.6
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


@dataclass
class RowRules:
    """What a row may emit next, given the tokens it has sampled so far."""

    tokens: WhisperTokens
    suppress: np.ndarray = field(init=False)

    def __post_init__(self):
        t = self.tokens
        ids = set(t.suppress) | {t.transcribe, t.sot, t.sot_prev, t.no_timestamps}
        ids |= {i for i in (t.translate, t.no_speech) if i is not None}
        ids |= set(t.languages.values())
        self.suppress = np.array(sorted(i for i in ids if i is not None and i < t.vocab_size), dtype=np.int64)

    def apply(self, logits: np.ndarray, sampled: list[int]) -> np.ndarray:
        t = self.tokens
        ts = t.timestamp_begin
        logits = logits.copy()
        logits[self.suppress] = -np.inf
        if not sampled:
            logits[[i for i in t.suppress_begin if i < logits.size]] = -np.inf
            logits[:ts] = -np.inf  # the first token is a timestamp
            logits[ts + round(MAX_INITIAL_TIMESTAMP_S / SECONDS_PER_TIMESTAMP) + 1 :] = -np.inf
            return logits
        last_ts = sampled[-1] >= ts
        penultimate_ts = len(sampled) < 2 or sampled[-2] >= ts
        if last_ts:
            if penultimate_ts:
                logits[ts:] = -np.inf  # after a pair of timestamps: text
            else:
                logits[: t.eot] = -np.inf  # after text + timestamp: a timestamp or the end
        stamps = [s for s in sampled if s >= ts]
        if stamps:  # timestamps never go back
            floor = stamps[-1] if last_ts and not penultimate_ts else stamps[-1] + 1
            logits[ts:floor] = -np.inf
        lp = log_softmax(logits)
        stamp_lp = np.logaddexp.reduce(lp[ts:])
        if stamp_lp > lp[:ts].max():
            logits[:ts] = -np.inf
        return logits


def choose(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> tuple[int, float]:
    """(token, its log probability)."""
    lp = log_softmax(logits)
    if temperature <= 0:
        token = int(np.argmax(logits))
    else:
        p = np.exp(log_softmax(logits / temperature))
        token = int(rng.choice(p.size, p=p / p.sum()))
    return token, float(lp[token])


def compression_ratio(text: str) -> float:
    raw = text.encode()
    return len(raw) / max(len(zlib.compress(raw)), 1)


def needs_fallback(avg_logprob: float, ratio: float, no_speech_prob: float) -> bool:
    if no_speech_prob > NO_SPEECH_THRESHOLD and avg_logprob < LOGPROB_THRESHOLD:
        return False  # silence: keep the (empty) result
    return ratio > COMPRESSION_RATIO_THRESHOLD or avg_logprob < LOGPROB_THRESHOLD


@dataclass
class Segment:
    start: float
    end: float
    tokens: list[int]
    text: str = ""


def split_segments(sampled: list[int], tok: WhisperTokens, offset: float, window_s: float) -> list[Segment]:
    """Timestamp-delimited segments of one window, in seconds from the start of the audio."""
    ts = tok.timestamp_begin
    segments: list[Segment] = []
    start: float | None = None
    text: list[int] = []
    for s in sampled:
        if s == tok.eot:
            break
        if s >= ts:
            at = (s - ts) * SECONDS_PER_TIMESTAMP
            if start is not None and text:
                segments.append(Segment(start, at, text))
                start, text = None, []
            else:
                start = at
        else:
            if start is None:
                start = segments[-1].end if segments else 0.0
            text.append(s)
    if text:
        segments.append(Segment(start or 0.0, window_s, text))
    out = []
    for seg in segments:
        seg.text = tok.decode(seg.tokens)
        if seg.text.strip():
            start_s = min(seg.start, window_s)
            end_s = min(max(seg.end, start_s), window_s)
            seg.start, seg.end = round(offset + start_s, 3), round(offset + end_s, 3)
            out.append(seg)
    return out
