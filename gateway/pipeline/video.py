"""Video inputs for vision models, shared by every chat API (OpenAI `video_url` parts,
Responses `input_video`, Anthropic `video` blocks, Ollama `images` holding a video).

The API parsers turn each video into a message part {"type": "video", "source": ...} holding
its bytes (data: URLs, base64) or an http(s) URL (fetched only where the operator allows image
URLs, with the same guards). `collect_videos` then samples each video's frames in a child
process (video_job.py: bounded before decoding, killed at its deadline) and moves them out of
the messages into the request's `videos`, leaving {"type": "video"} where the chat template
places the video's tokens. The worker turns the frames into video tokens; a model whose
processor takes no video refuses there, by name."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import re
from collections import OrderedDict
from dataclasses import asdict, dataclass

from ...shared.errors import invalid
from ..web.state import ImageLimits
from ..web.work_pools import JobFailed, JobTimeout, run_process_job
from .images import _DATA_URL, _fetch, media_parts, with_placeholders

MAX_VIDEOS = 4  # per request
MAX_VIDEO_BYTES = 64 << 20  # per video (the request body limit usually bounds it first)
DECODE_TIMEOUT_S = 60.0
# mlx-vlm's defaults (utils.DEFAULT_VIDEO_SAMPLING), which Qwen-VL processors declare too.
DEFAULT_FPS = 2.0
MIN_FRAMES = 4
FRAME_FACTOR = 2  # the temporal patch: frames go in pairs
MAX_FRAMES = 64  # sampled frames per video: the cap on video_max_frames


@dataclass(frozen=True)
class VideoDecodeLimits:
    """What the decoding job refuses before and while it decodes (video_job.py)."""

    max_duration_s: float = 600.0
    max_source_frames: int = 36_000  # ten minutes at 60 frames a second
    max_source_pixels: int = 3840 * 2160  # a 4K frame
    max_frame_pixels: int = 1024 * 768  # sampled frames are scaled down to this before the worker


LIMITS = VideoDecodeLimits()


def _sniff(data: bytes) -> bool:
    """MP4/MOV (an ISO base media `ftyp` box), WebM/Matroska (EBML), AVI (RIFF AVI)."""
    return (
        data[4:8] == b"ftyp" or data.startswith(b"\x1a\x45\xdf\xa3") or (data[:4] == b"RIFF" and data[8:12] == b"AVI ")
    )


def checked(data: bytes, where: str) -> bytes:
    if not data:
        raise invalid(f"{where}: the video is empty", "messages")
    if len(data) > MAX_VIDEO_BYTES:
        raise invalid(f"{where}: the video is {len(data)} bytes; the limit is {MAX_VIDEO_BYTES} bytes", "messages")
    if not _sniff(data):
        raise invalid(f"{where}: the data is not an MP4, MOV, WebM, MKV or AVI video", "messages")
    return data


def _b64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(re.sub(r"\s+", "", data), validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{where}: the video data is not valid base64", "messages") from None


def no_video(param: str = "messages"):
    return invalid("this model does not accept video; use a vision model that reads video (Qwen2-VL family)", param)


def from_url(url, where: str, limits: ImageLimits | None) -> dict:
    """A video as a data: URL, bare base64, or an http(s) URL (fetched only when allowed)."""
    if limits is None:
        raise no_video()
    if not isinstance(url, str) or not url:
        raise invalid(f"{where}: the video URL must be a non-empty string", "messages")
    match = _DATA_URL.match(url)
    if match:
        if ";base64" not in match["params"].lower():
            raise invalid(f"{where}: data: URLs must be base64-encoded", "messages")
        return {"type": "video", "source": checked(_b64(match["data"], where), where)}
    if url.lower().startswith(("http://", "https://")):
        if not limits.allow_urls:
            raise invalid(
                f"{where}: video URLs are not fetched by this server; send the video as a data: URL", "messages"
            )
        return {"type": "video", "source": url}
    return {"type": "video", "source": checked(_b64(url, where), where)}


def from_openai_part(part: dict, where: str, limits: ImageLimits | None) -> dict:
    """`video_url` (Chat Completions, vllm-mlx) or `input_video` (Responses): a string or {"url"}."""
    url = part.get("video_url", part.get("video"))
    if isinstance(url, dict):
        url = url.get("url")
    return from_url(url, where, limits)


def from_anthropic_block(block: dict, where: str, limits: ImageLimits | None) -> dict:
    """An Anthropic-style {"type": "video", "source": {"type": "base64" | "url", ...}}."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise invalid(f"{where}: a video block needs a source", "messages")
    if source.get("type") == "url":
        return from_url(source.get("url"), where, limits)
    if source.get("type") != "base64" or not isinstance(source.get("data"), str):
        raise invalid(f"{where}: a video source is base64 data or a url", "messages")
    if limits is None:
        raise no_video()
    return {"type": "video", "source": checked(_b64(source["data"], where), where)}


def is_video(data: bytes) -> bool:
    """Ollama sends videos in `images`, as bare base64: told apart by the file signature."""
    return _sniff(data)


class _Sampled:
    """The frames of the last videos sampled, by the file's digest and the sampling: a
    conversation resends its clip every turn, and the turns after the first neither decode
    it again nor wait for a job slot. Bounded in entries and in bytes."""

    MAX_ENTRIES = 8
    MAX_BYTES = 64 << 20

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple, dict] = OrderedDict()

    def get(self, key: tuple) -> dict | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: tuple, sampled: dict) -> None:
        self._entries[key] = sampled
        while len(self._entries) > self.MAX_ENTRIES or self._bytes() > self.MAX_BYTES:
            self._entries.popitem(last=False)

    def _bytes(self) -> int:
        return sum(len(f) for s in self._entries.values() for f in s["frames"])


SAMPLED = _Sampled()


async def sample_frames(data: bytes, fps: float | None, max_frames: int | None, where: str) -> dict:
    """{"frames": [JPEG bytes], "fps": the sampled rate} of one video, or a 400 saying why."""
    import json

    key = (hashlib.sha256(data).digest(), fps, max_frames)
    found = SAMPLED.get(key)
    if found is not None:
        return found
    header = {
        "fps": fps or DEFAULT_FPS,
        "min_frames": MIN_FRAMES,
        "max_frames": min(max_frames or MAX_FRAMES, MAX_FRAMES),
        "frame_factor": FRAME_FACTOR,
        "limits": asdict(LIMITS),
    }
    job = json.dumps(header).encode() + b"\n" + data
    try:
        out = await run_process_job("mlxgw.gateway.pipeline.video_job", job, DECODE_TIMEOUT_S)
    except JobTimeout:
        raise invalid(f"{where}: decoding the video took longer than {DECODE_TIMEOUT_S:.0f} s", "messages") from None
    except JobFailed as e:
        raise invalid(f"{where}: the video could not be read: {e}", "messages") from None
    sampled = {"frames": [base64.b64decode(f) for f in out["frames"]], "fps": float(out["fps"])}
    SAMPLED.put(key, sampled)
    return sampled


async def collect_videos(
    messages: list[dict], limits: ImageLimits | None, fps: float | None, max_frames: int | None
) -> tuple[list[dict], list[dict] | None]:
    """The messages with each video part reduced to {"type": "video"}, and the videos' frames
    in order (None: no videos). The input messages are not modified."""
    sources = [part.get("source") for part in media_parts(messages, "video")]
    if not sources:
        return messages, None
    if limits is None:
        raise no_video()
    if len(sources) > MAX_VIDEOS:
        raise invalid(f"the request has {len(sources)} videos; the limit is {MAX_VIDEOS}", "messages")

    async def one(i: int, source) -> dict:
        if isinstance(source, str):
            source = await _fetch(source, limits, check=checked, max_bytes=MAX_VIDEO_BYTES)
        return await sample_frames(source, fps, max_frames, f"video {i}")

    videos = await asyncio.gather(*(one(i, s) for i, s in enumerate(sources)))
    return with_placeholders(messages, "video"), list(videos)
