"""A Piper voice (ONNX, run by onnxruntime; no MLX text-to-speech weights ship on PyPI) for
a `kind: speech` worker. Optional: `pip install piper-tts` (the `speech` extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class PiperRunner:
    context_length = 4096  # characters of input, as OpenAI's limit

    def __init__(self, folder: Path):
        from piper import PiperVoice

        self.voice = PiperVoice.load(folder / "voice.onnx", folder / "voice.onnx.json")
        self.sample_rate = int(self.voice.config.sample_rate)
        self.sentences = 0

    def synthesize(self, text: str, speed: float) -> np.ndarray:
        from piper.config import SynthesisConfig

        config = SynthesisConfig(length_scale=1.0 / speed)
        chunks = [c.audio_int16_array for c in self.voice.synthesize(text, syn_config=config)]
        self.sentences += len(chunks)
        return np.concatenate(chunks) if chunks else np.zeros(0, np.int16)

    def stats(self) -> dict:
        return {"sentences": self.sentences, "sample_rate": self.sample_rate}

    def cache_stats(self) -> dict:
        return {}

    def cache_clear(self) -> None:
        pass
