"""OpenAI Audio: POST /v1/audio/transcriptions and /v1/audio/translations on Whisper workers.

Multipart form as OpenAI takes it (file, model, language, prompt, response_format,
temperature, stream). The upload is read with its own cap (25 MB, OpenAI's), decoded to
16 kHz mono PCM off the event loop, and sent to a `kind: audio` worker; the worker returns
timestamped segments, rendered here as json, text, srt, vtt or verbose_json, or streamed as
`transcript.text.delta` / `transcript.text.done` events."""

from __future__ import annotations

import math

from aiohttp import web

from ....shared import protocol as p
from ....shared.errors import ErrorCode, ServiceError, invalid
from ....shared.events import Finish
from ....shared.model_sections import ModelKind
from ...access.auth import charge_audio_seconds, resolve_model
from ...pipeline.audio_decode import AudioError, audio_seconds_cap, decode_audio
from ...pipeline.body import form_parts, read_capped
from ...pipeline.serving import generation
from ...web.errors import openai_error_body
from ...web.sse import SSEWriter
from ...web.state import SETTINGS
from ...web.work_pools import THREAD_POOLS
from . import speech
from .audio_format import render

routes = web.RouteTableDef()

MAX_UPLOAD_BYTES = 25 * 1024 * 1024  # OpenAI's limit


MAX_FIELD_BYTES = 64 * 1024  # a text field (prompt, ...)
FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
TEXT_FIELDS = {"model", "language", "prompt", "response_format", "temperature", "stream", "timestamp_granularities[]"}
IGNORED_FIELDS = {"chunking_strategy", "include[]"}  # accepted as OpenAI does; no effect here


async def read_form(request: web.Request, fields: set[str]) -> tuple[bytes | None, dict[str, list[str]]]:
    """(file bytes, text fields) from a multipart form, refusing oversize parts and unknown
    fields with a 400 that names them."""
    data: bytes | None = None
    text: dict[str, list[str]] = {}
    async for part in form_parts(request, "the audio", "file"):
        name = part.name or ""
        if name == "file":
            data = await _read_part(part, MAX_UPLOAD_BYTES, "file")
        elif name in fields:
            raw = await _read_part(part, MAX_FIELD_BYTES, name)
            text.setdefault(name, []).append(raw.decode("utf-8", errors="replace"))
        elif name in IGNORED_FIELDS:
            await _read_part(part, MAX_FIELD_BYTES, name)
        else:
            known = ", ".join(sorted({"file", *fields}))
            raise invalid(f"unrecognized form field {name!r} (known: {known})", name or None)
    return data, text


async def _read_part(part, cap: int, name: str) -> bytes:
    data = await read_capped(part, cap)
    if data is None and name == "file":
        raise ServiceError(
            ErrorCode.BODY_TOO_LARGE, f"the file is larger than the limit of {cap >> 20} MB", param="file"
        )
    if data is None:
        raise invalid(f"'{name}' is longer than {cap} bytes", name)
    return data


def _one(text: dict[str, list[str]], name: str) -> str | None:
    values = text.get(name)
    return values[-1].strip() if values else None


def _temperature(text: dict[str, list[str]]) -> float:
    raw = _one(text, "temperature")
    if raw in (None, ""):
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise invalid("'temperature' must be a number between 0 and 1", "temperature") from None
    if not 0 <= value <= 1 or math.isnan(value):
        raise invalid("'temperature' must be a number between 0 and 1", "temperature")
    return value


def _stream(text: dict[str, list[str]]) -> bool:
    raw = (_one(text, "stream") or "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise invalid("'stream' must be true or false", "stream")
    return raw in ("true", "1")


async def _handle(request: web.Request, task: str) -> web.StreamResponse:
    fields = TEXT_FIELDS - ({"language", "stream", "timestamp_granularities[]"} if task == "translate" else set())
    data, text = await read_form(request, fields)
    model = _one(text, "model")
    if not model:
        raise invalid("'model' is required", "model")
    slot = resolve_model(request, model, (ModelKind.AUDIO,))
    if data is None:
        raise invalid("'file' is required: the audio file to transcribe, as a multipart file field", "file")
    fmt = _one(text, "response_format") or "json"
    if fmt not in FORMATS:
        raise invalid(f"'response_format' must be one of {', '.join(FORMATS)}", "response_format")
    granularities = set(text.get("timestamp_granularities[]", []))
    if granularities - {"segment", "word"}:
        raise invalid("'timestamp_granularities[]' takes 'segment' and 'word'", "timestamp_granularities[]")
    if granularities and fmt != "verbose_json":
        raise invalid("'timestamp_granularities[]' needs response_format verbose_json", "timestamp_granularities[]")
    stream = _stream(text)
    if stream and fmt not in ("json", "text"):
        raise invalid("streaming supports response_format json or text", "stream")
    temperature = _temperature(text)
    try:
        cap = audio_seconds_cap(request.app[SETTINGS].request_timeout_s)
        audio = await THREAD_POOLS["audio"].run(decode_audio, data, cap)
    except AudioError as e:
        raise invalid(str(e), "file") from None
    request["audio_seconds"] = audio.seconds
    charge_audio_seconds(request, audio.seconds)
    req = p.TranscribeRequest(
        rid=request["rid"],
        audio=audio.pcm,
        task=task,
        language=_one(text, "language") or None,
        prompt=_one(text, "prompt") or None,
        temperature=temperature,
        stream=stream,
        word_timestamps="word" in granularities,
        timeout_s=request.app[SETTINGS].request_timeout_s,
    )
    gen = generation(request, slot, req)
    if stream:
        return await _stream_response(request, gen)
    async with gen:
        done = await gen.finish_event()
    body, content_type = render(fmt, task, done)
    return web.Response(text=body, content_type=content_type)


async def _stream_response(request: web.Request, gen) -> web.StreamResponse:
    sse = SSEWriter(request, request.app[SETTINGS].write_timeout_s)
    gen.on_wait = sse.comment
    parts: list[str] = []
    try:
        async with gen:
            async for ev in gen.content(on_idle=sse.comment):
                delta = ev.text or ""
                if delta:
                    parts.append(delta)
                    await sse.data({"type": "transcript.text.delta", "delta": delta, "logprobs": None})
                if type(ev) is Finish:
                    u = gen.usage
                    usage = {
                        "type": "tokens",
                        "input_tokens": u.prompt_tokens,
                        "output_tokens": u.completion_tokens,
                        "total_tokens": u.total_tokens,
                    }
                    done = {"type": "transcript.text.done", "text": "".join(parts).strip(), "logprobs": None}
                    await sse.data({**done, "usage": usage})
    except ServiceError as err:
        if not sse.opened:
            raise
        await sse.error(openai_error_body(err))
    await sse.close()
    return sse.response


@routes.post("/v1/audio/transcriptions")
async def transcriptions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "transcribe")


@routes.post("/v1/audio/translations")
async def translations(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "translate")


# Text to speech lives in its own module; its route is registered with these.
routes.post("/v1/audio/speech")(speech.create_speech)
