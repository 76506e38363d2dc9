"""What a vision runner's prompts carry besides token ids: decoded images and video frames, and
the key their prefix-cache blocks are filed under (the media's content and the request's
cache scope), from encode() on the preparation thread to insert() on the engine thread."""

from __future__ import annotations

import hashlib
import io

from ....shared.errors import invalid
from ....shared.protocol import GenerateRequest

# Larger images are refused before decoding (a small file can decode to gigapixels).
MAX_IMAGE_PIXELS = 40_000_000
MAX_VIDEO_FRAMES = 256  # per video; the gateway samples at most 64


class MediaPrompt(list):
    """Token ids that also carry the processor's outputs (pixel values, grid sizes, ...)
    from encode() to insert(), through a scheduler that only sees a list of ids, and the
    prefix-cache key of the prompt (cache_key: media_key below)."""

    media: dict | None = None
    cache_key: int | None = None


def decode_image(data: bytes, index: int):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_IMAGE_PIXELS:
            raise invalid(
                f"image {index} is {img.width}x{img.height} pixels; the limit is {MAX_IMAGE_PIXELS} pixels", "messages"
            )
        img.load()
        return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise invalid(f"image {index} could not be decoded: {e}", "messages") from None


def decode_video(frames: list[bytes], index: int):
    """A video's sampled frames (JPEG, from the gateway's decoding job) as (T, C, H, W) uint8."""
    import numpy as np

    if not frames or len(frames) > MAX_VIDEO_FRAMES:
        raise invalid(f"video {index} has {len(frames)} frames; 1 to {MAX_VIDEO_FRAMES} are taken", "messages")
    pictures = [np.asarray(decode_image(data, index)) for data in frames]
    if len({p.shape for p in pictures}) != 1:
        raise invalid(f"video {index}: its frames differ in size", "messages")
    return np.stack(pictures).transpose(0, 3, 1, 2)


def audio_seconds_heard(processor) -> float | None:
    """The longest audio part the model hears, in seconds, where its processor says (Gemma 4:
    750 tokens of 40 ms), else None. Longer parts would be cut short by the processor."""
    tokens = getattr(processor, "audio_seq_length", None)
    ms_per_token = getattr(processor, "audio_ms_per_token", None)
    if not tokens or not ms_per_token:
        return None
    return tokens * ms_per_token / 1000


def media_slots(messages: list[dict], kind: str) -> int:
    """How many {"type": kind} parts the messages hold."""
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == kind
    )


def media_key(req: GenerateRequest) -> int:
    """The prefix-cache salt of a request's blocks: its cache scope (namespace, adapter) and
    the content of every image, video frame (with the rate it was sampled at) and audio part.
    Equal token ids with other media, or from another scope, never share a block; a second
    turn about the same video finds the first turn's blocks, video tokens included."""
    h = hashlib.sha256()
    h.update(f"{req.cache_namespace or ''}\0{req.adapter or ''}\0".encode())
    for data in req.images or ():
        h.update(b"image" + hashlib.sha256(data).digest())
    for video in req.videos or ():
        h.update(f"video {float(video.get('fps') or 0):.6f}".encode())
        for frame in video.get("frames") or ():
            h.update(hashlib.sha256(frame).digest())
    for pcm in req.audio or ():
        h.update(b"audio" + hashlib.sha256(pcm).digest())
    return int.from_bytes(h.digest()[:8], "big") >> 2  # a positive int64 for mlx-vlm's hash chain
