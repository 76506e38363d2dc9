"""Uploaded audio -> 16 kHz mono 16-bit PCM, in-process with PyAV (its wheels bundle FFmpeg's
libraries; there is no ffmpeg command to shell out to).

Runs in the gateway, in a thread (PyAV releases the GIL while decoding): a file that is not
audio, is corrupt or is too long is refused with a 400 before any worker sees it, the
request's audio seconds are known before admission (per-key limits count them), and the
worker's engine loop is never stalled by decoding while other requests are batched."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 16000


class AudioError(ValueError):
    """The upload is not usable audio; the message says why."""


@dataclass
class DecodedAudio:
    pcm: bytes  # int16 little-endian, mono, SAMPLE_RATE
    seconds: float
    format: str


def decode_audio(data: bytes, max_seconds: float) -> DecodedAudio:
    """Decode any format FFmpeg reads (wav, mp3, m4a/aac, ogg/opus, flac, webm, ...)."""
    import av

    if not data:
        raise AudioError("the uploaded file is empty")
    limit = int(max_seconds * SAMPLE_RATE)
    chunks: list[np.ndarray] = []
    total = 0
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            streams = [s for s in container.streams if s.type == "audio"]
            if not streams:
                raise AudioError("the uploaded file has no audio stream")
            fmt = container.format.name
            resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
            for frame in container.decode(streams[0]):
                for out in resampler.resample(frame):
                    chunk = out.to_ndarray().reshape(-1)
                    chunks.append(chunk)
                    total += chunk.size
                if total > limit:
                    raise AudioError(f"the audio is longer than the limit of {max_seconds:g} seconds")
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
                total += chunks[-1].size
    except AudioError:
        raise
    except Exception as e:  # PyAV raises many FFmpeg error types for bad input
        raise AudioError(f"the uploaded file could not be decoded as audio ({type(e).__name__})") from None
    if total == 0:
        raise AudioError("the uploaded file contains no audio samples")
    if total > limit:
        raise AudioError(f"the audio is longer than the limit of {max_seconds:g} seconds")
    pcm = np.concatenate(chunks).astype("<i2")
    return DecodedAudio(pcm.tobytes(), total / SAMPLE_RATE, fmt)
