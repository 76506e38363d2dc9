"""Audio files whose headers make decoding a bomb (issue 26), built in memory."""

from __future__ import annotations

import io
import struct

import numpy as np


def wav(rate: int, samples: int, channels: int = 1) -> bytes:
    """16-bit PCM silence with the given header rate and channel count."""
    data = b"\x00\x00" * samples * channels
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * 2 * channels, 2 * channels, 16)
    return (
        b"RIFF"
        + struct.pack("<I", 36 + len(data))
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", len(data))
        + data
    )


def flac_silence(seconds: float, rate: int = 1000) -> bytes:
    """A small FLAC of `seconds` of silence (115 minutes: 0.5 MB)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="flac") as out:
        stream = out.add_stream("flac", rate=rate, layout="mono")
        frame_samples = 4096
        total = int(seconds * rate)
        zeros = np.zeros((1, frame_samples), dtype=np.int16)
        pts = 0
        while pts < total:
            frame = av.AudioFrame.from_ndarray(zeros, format="s16", layout="mono")
            frame.sample_rate = rate
            frame.pts = pts
            pts += frame_samples
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()
