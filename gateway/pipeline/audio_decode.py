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
MIN_RATE, MAX_RATE = 1000, 384_000  # Hz: a header outside this is a decoding bomb (1 Hz -> x16000)
MAX_CHANNELS = 32
MAX_AUDIO_SECONDS = 2 * 3600.0  # decoded int16 PCM: 230 MB at most
# Audio seconds a request may bring per second of its request timeout: what a small machine
# can transcribe before the timeout (a 2-hour file on a 300-s timeout was decoded, 1 GB, to
# end in a 504). The default timeout of 300 s allows 20 minutes.
AUDIO_SECONDS_PER_TIMEOUT_S = 4.0


def audio_seconds_cap(request_timeout_s: float) -> float:
    return min(MAX_AUDIO_SECONDS, request_timeout_s * AUDIO_SECONDS_PER_TIMEOUT_S)


class AudioError(ValueError):
    """The upload is not usable audio; the message says why."""


@dataclass
class DecodedAudio:
    pcm: bytes  # int16 little-endian, mono, SAMPLE_RATE
    seconds: float
    format: str


def check_declared(container, stream, max_seconds: float) -> None:
    """Refuse from the header, before decoding: its rate, channels and declared length."""
    rate = stream.codec_context.sample_rate or stream.rate or 0
    if rate and not MIN_RATE <= rate <= MAX_RATE:
        raise AudioError(f"the audio's sample rate of {rate} Hz is outside {MIN_RATE}-{MAX_RATE} Hz")
    channels = stream.codec_context.channels or 0
    if channels > MAX_CHANNELS:
        raise AudioError(f"the audio has {channels} channels; the limit is {MAX_CHANNELS}")
    declared = []
    if stream.duration and stream.time_base:
        declared.append(float(stream.duration * stream.time_base))
    if container.duration:
        declared.append(container.duration / 1_000_000)  # AV_TIME_BASE
    if declared and max(declared) > max_seconds:
        raise AudioError(
            f"the audio is {max(declared):.0f} seconds long (from its header); the limit is {max_seconds:g} seconds"
        )


def check_frame(frame, total: int, limit: int, max_seconds: float) -> None:
    """A frame's own rate can differ from the header's: refuse before resampling it."""
    rate = frame.sample_rate or 0
    if not MIN_RATE <= rate <= MAX_RATE:
        raise AudioError(f"the audio's sample rate of {rate} Hz is outside {MIN_RATE}-{MAX_RATE} Hz")
    if total + frame.samples * SAMPLE_RATE / rate > limit:
        raise AudioError(f"the audio is longer than the limit of {max_seconds:g} seconds")


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
            check_declared(container, streams[0], max_seconds)
            resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
            for frame in container.decode(streams[0]):
                check_frame(frame, total, limit, max_seconds)
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
