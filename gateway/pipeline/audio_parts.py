"""Audio parts in chat messages: OpenAI's `input_audio` ({"data": base64, "format"}) and
`audio_url` (a data: URL, or an http(s) URL where the operator allows fetching image URLs).

The API parsers turn each into {"type": "audio", "source": bytes | url}; `collect_audio`
then decodes every part in the gateway's audio pool (pipeline/audio_decode.py: FFmpeg behind
the same declared-length and per-frame checks as /v1/audio/transcriptions) and does one of
three things, by the model's entry:

- `chat.audio_model` names a speech-to-text model (`kind: audio`): each part is transcribed by
  it and its text put in the part's place; the response says so in the
  `x-mlxgw-transcribed-content` header (the model never heard the audio).
- a vision model: the audio goes to its worker, whose mlx-vlm processor takes it where the
  family reads audio (Gemma 4, Gemma 3n, ...), and refuses by name where it does not.
- any other model: a 400 saying why, and how an operator turns transcription on."""

from __future__ import annotations

import asyncio
import base64
import binascii
import re

from aiohttp import web

from ...shared import protocol as p
from ...shared.errors import ErrorCode, ServiceError, invalid
from ...shared.model_sections import ModelKind
from ..access.auth import charge_audio_seconds
from ..models.generation import Generation
from ..web.state import MANAGER, SETTINGS
from ..web.work_pools import THREAD_POOLS
from .audio_decode import AudioError, audio_seconds_cap, decode_audio
from .images import _DATA_URL, _fetch, media_parts

MAX_AUDIO_PARTS = 4  # per request
MAX_AUDIO_BYTES = 25 << 20  # per part: OpenAI's upload limit
FORMATS = {"wav", "mp3", "flac", "ogg", "opus", "m4a", "aac", "webm", "pcm16"}


def _b64(data, where: str) -> bytes:
    if not isinstance(data, str) or not data:
        raise invalid(f"{where}: the audio data must be a non-empty base64 string", "messages")
    try:
        raw = base64.b64decode(re.sub(r"\s+", "", data), validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{where}: the audio data is not valid base64", "messages") from None
    return _checked(raw, where)


def _checked(data: bytes, where: str) -> bytes:
    if not data:
        raise invalid(f"{where}: the audio is empty", "messages")
    if len(data) > MAX_AUDIO_BYTES:
        raise invalid(f"{where}: the audio is {len(data)} bytes; the limit is {MAX_AUDIO_BYTES}", "messages")
    return data


def from_openai_part(part: dict, where: str) -> dict:
    """`input_audio` ({"data", "format"}) or `audio_url` (a string or {"url"})."""
    if part.get("type") == "input_audio":
        spec = part.get("input_audio")
        if not isinstance(spec, dict):
            raise invalid(f"{where}.input_audio must be an object with 'data' and 'format'", "messages")
        fmt = spec.get("format")
        if fmt is not None and fmt not in FORMATS:
            raise invalid(f"{where}.input_audio.format must be one of {', '.join(sorted(FORMATS))}", "messages")
        return {"type": "audio", "source": _b64(spec.get("data"), where)}
    url = part.get("audio_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise invalid(f"{where}: the audio URL must be a non-empty string", "messages")
    match = _DATA_URL.match(url)
    if match:
        if ";base64" not in match["params"].lower():
            raise invalid(f"{where}: data: URLs must be base64-encoded", "messages")
        return {"type": "audio", "source": _b64(match["data"], where)}
    if url.lower().startswith(("http://", "https://")):
        return {"type": "audio", "source": url}
    raise invalid(f"{where}: the audio must be a data: URL or input_audio data", "messages")


async def _pcm(request: web.Request, source, where: str) -> bytes:
    """16 kHz mono int16 PCM of one part, or a 400 naming why not."""
    settings = request.app[SETTINGS]
    if isinstance(source, str):
        if not settings.images.allow_urls:
            raise invalid(f"{where}: audio URLs are not fetched by this server; send input_audio data", "messages")
        source = await _fetch(source, settings.images, check=_checked, max_bytes=MAX_AUDIO_BYTES)
    try:
        audio = await THREAD_POOLS["audio"].run(decode_audio, source, audio_seconds_cap(settings.request_timeout_s))
    except AudioError as e:
        raise invalid(f"{where}: {e}", "messages") from None
    charge_audio_seconds(request, audio.seconds)
    return audio.pcm


async def _transcript(request: web.Request, name: str, pcm: bytes, index: int) -> str:
    manager = request.app[MANAGER]
    slot = manager.resolve(name)
    if slot is None or slot.entry.kind != ModelKind.AUDIO:
        raise ServiceError(ErrorCode.INTERNAL, f"chat.audio_model '{name}' is not a speech-to-text model")
    key = request.get("key")
    req = p.TranscribeRequest(
        rid=f"{request['rid']}-audio{index}", audio=pcm, timeout_s=request.app[SETTINGS].request_timeout_s
    )
    gen = Generation(manager, slot, req, request.app[SETTINGS].keepalive_s, owner=key.name if key else None)
    async with gen:
        done = await gen.finish_event()
    return "".join(s["text"] for s in done.segments or ()).strip()


async def collect_audio(
    request: web.Request, slot, messages: list[dict]
) -> tuple[list[dict], list[bytes] | None, bool]:
    """(messages, audio PCM for the worker or None, whether parts were transcribed)."""
    parts = media_parts(messages, "audio")
    if not parts:
        return messages, None, False
    if len(parts) > MAX_AUDIO_PARTS:
        raise invalid(f"the request has {len(parts)} audio parts; the limit is {MAX_AUDIO_PARTS}", "messages")
    transcriber = slot.entry.chat.audio_model
    if transcriber is None and slot.entry.kind != ModelKind.VISION:
        raise invalid(
            "this model does not accept audio; an operator can set chat.audio_model to a speech-to-text "
            "model so audio parts are transcribed for it",
            "messages",
        )
    pcms = await asyncio.gather(*(_pcm(request, part.get("source"), f"audio {i}") for i, part in enumerate(parts)))
    if transcriber is None:
        replace = {id(part): {"type": "audio"} for part in parts}
        return _replaced(messages, replace), list(pcms), False
    texts = await asyncio.gather(*(_transcript(request, transcriber, pcm, i) for i, pcm in enumerate(pcms)))
    replace = {id(part): {"type": "text", "text": f"[audio transcript] {text}"} for part, text in zip(parts, texts)}
    return _replaced(messages, replace), None, True


def _replaced(messages: list[dict], replace: dict[int, dict]) -> list[dict]:
    """The messages with each audio part swapped (the caller's messages are not modified)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(id(x) in replace for x in content):
            parts = [replace.get(id(x), x) for x in content]
            if all(x.get("type") == "text" for x in parts):  # text only now: what every template takes
                parts = "\n".join(x["text"] for x in parts)
            m = {**m, "content": parts}
        out.append(m)
    return out
