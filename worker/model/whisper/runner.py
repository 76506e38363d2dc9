"""The Whisper model in a worker: log-mel features, batched encoder passes, batched decoder
prefill and steps. Counters say how much was shared (encoder passes vs windows encoded)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from .model import DecoderCache, Whisper, WhisperDims
from .tokenizer import WhisperTokens

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
WINDOW_SECONDS = 30
WINDOW_SAMPLES = WINDOW_SECONDS * SAMPLE_RATE
N_FRAMES = WINDOW_SAMPLES // HOP_LENGTH


def mel_filters(n_mels: int, sr: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """Slaney-style mel filterbank (librosa's default, which Whisper was trained with)."""

    def hz_to_mel(f):
        f = np.asanyarray(f, dtype=np.float64)
        mels = f / (200.0 / 3)
        log_region = f >= 1000.0
        return np.where(log_region, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0), mels)

    def mel_to_hz(m):
        m = np.asanyarray(m, dtype=np.float64)
        freqs = m * (200.0 / 3)
        return np.where(m >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0)), freqs)

    fft_freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    mel_f = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sr / 2), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels]))[:, None]
    return weights.astype(np.float32)


class WhisperRunner:
    def __init__(self, folder: Path):
        config = json.loads((folder / "config.json").read_text())
        config.pop("model_type", None)
        self.dims = WhisperDims(**config)
        self.model = Whisper(self.dims)
        weights = mx.load(str(folder / "weights.safetensors"))
        self.model.load_weights(list(weights.items()), strict=True)
        self.dtype = next(iter(weights.values())).dtype
        self.model.encoder._positional_embedding = self.model.encoder._positional_embedding.astype(self.dtype)
        mx.eval(self.model.parameters())
        self.tokens = WhisperTokens.load(folder, self.dims.n_vocab)
        self._filters = mel_filters(self.dims.n_mels)
        self._window = np.hanning(N_FFT + 1)[:-1].astype(np.float32)
        self.context_length = self.dims.n_text_ctx
        self.encoder_passes = 0
        self.windows_encoded = 0
        self.decode_steps = 0
        self.rows_stepped = 0

    # -- features ------------------------------------------------------------------------
    def log_mel(self, audio: np.ndarray) -> np.ndarray:
        """One window of float32 samples (at most 30 s) -> (N_FRAMES, n_mels)."""
        x = np.zeros(WINDOW_SAMPLES, np.float32)
        x[: min(audio.size, WINDOW_SAMPLES)] = audio[:WINDOW_SAMPLES]
        x = np.pad(x, N_FFT // 2, mode="reflect")
        frames = np.lib.stride_tricks.sliding_window_view(x, N_FFT)[::HOP_LENGTH][:N_FRAMES]
        mag = np.abs(np.fft.rfft(frames * self._window, axis=-1)) ** 2
        mel = mag @ self._filters.T
        log_spec = np.log10(np.maximum(mel, 1e-10))
        log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
        return ((log_spec + 4.0) / 4.0).astype(np.float32)

    def encode(self, windows: list[np.ndarray]) -> mx.array:
        """Audio features for several windows in one encoder pass: (batch, ctx, state)."""
        mels = mx.array(np.stack([self.log_mel(w) for w in windows])).astype(self.dtype)
        features = self.model.encoder(mels)
        mx.eval(features)
        self.encoder_passes += 1
        self.windows_encoded += len(windows)
        return features

    # -- decoder -------------------------------------------------------------------------
    def prefill(self, prompts: list[list[int]], features: mx.array) -> tuple[np.ndarray, DecoderCache]:
        """Prompts of equal length over their windows' features: (logits of every prompt
        position (batch, T, vocab), their cache)."""
        logits, cache = self.model.decoder.prefill(prompts, features)
        mx.eval(logits, *cache.self_k, *cache.self_v, *cache.cross_k, *cache.cross_v)
        return np.array(logits), cache

    def step(self, last_tokens: list[int], cache: DecoderCache) -> np.ndarray:
        logits = self.model.decoder.step(mx.array(last_tokens), cache)
        mx.eval(logits, *cache.self_k, *cache.self_v)
        self.decode_steps += 1
        self.rows_stepped += len(last_tokens)
        return np.array(logits)

    def detect_languages(self, features: mx.array) -> list[tuple[str, float]]:
        """(language code, probability) per window, from the logits after <|startoftranscript|>."""
        tok = self.tokens
        logits, _ = self.prefill([[tok.sot]] * features.shape[0], features)
        codes = list(tok.languages)
        ids = np.array([tok.languages[c] for c in codes])
        out = []
        for row in logits[:, 0, ids]:
            p = np.exp(row - row.max())
            p /= p.sum()
            best = int(np.argmax(p))
            out.append((codes[best], float(p[best])))
        return out

    # -- what the engine asks every runner -----------------------------------------------
    def stats(self) -> dict:
        return {
            "encoder_passes": self.encoder_passes,
            "windows_encoded": self.windows_encoded,
            "decode_steps": self.decode_steps,
            "rows_stepped": self.rows_stepped,
        }

    def cache_stats(self) -> dict:
        return {}

    def cache_clear(self) -> None:
        pass

    def encode_text(self, text: str) -> list[int]:
        return self.tokens.encode(text)
