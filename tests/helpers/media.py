"""Short videos made in the tests with PyAV (MPEG-4 Part 2 in MP4: no external encoder), and
hostile variants of them: a declared frame count patched to a million, cut-off files."""

from __future__ import annotations

import base64
import os
import struct
import tempfile


def mp4(frames: int = 30, rate: int = 10, width: int = 56, height: int = 56, faststart: bool = False) -> bytes:
    """A clip of `frames` frames at `rate` a second: a bar that grows left to right.
    faststart: the index (moov) first, so a cut-off copy still opens and declares its length."""
    import av
    import numpy as np

    fd, path = tempfile.mkstemp(suffix=".mp4")  # faststart rewrites the file: it needs a path
    os.close(fd)
    try:
        options = {"movflags": "faststart"} if faststart else {}
        with av.open(path, "w", format="mp4", options=options) as out:
            stream = out.add_stream("mpeg4", rate=rate)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for i in range(frames):
                img = np.zeros((height, width, 3), np.uint8)
                img[:, : max(1, (i + 1) * width // frames)] = (200, 40, 40)
                for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def declaring_frames(data: bytes, count: int) -> bytes:
    """The clip with its sample tables (stts, stsz) claiming `count` frames."""
    out = bytearray(data)
    stts = out.find(b"stts")
    out[stts + 12 : stts + 16] = struct.pack(">I", count)  # the first (only) entry's sample count
    stsz = out.find(b"stsz")
    out[stsz + 12 : stsz + 16] = struct.pack(">I", count)
    return bytes(out)


def video_url(data: bytes, media_type: str = "video/mp4") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"
