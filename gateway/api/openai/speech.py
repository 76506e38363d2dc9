"""OpenAI Audio: POST /v1/audio/speech on `kind: speech` workers (a Piper voice).

JSON body: model, input (at most 4096 characters), voice (any name: a Piper voice has one
speaker), response_format (mp3 default, opus, aac, flac, wav, pcm = raw 24 kHz 16-bit mono
as OpenAI sends it), speed (0.25 to 4). The worker returns 16-bit PCM; it is encoded here
with PyAV, in a thread."""

from __future__ import annotations

import io

import numpy as np
from aiohttp import web

from ....shared import protocol as p
from ....shared.errors import invalid
from ....shared.model_sections import ModelKind
from ...access.auth import resolve_model
from ...pipeline.aux_fields import SpeechFields, required
from ...pipeline.body import read_object
from ...pipeline.fields import decode_fields
from ...pipeline.serving import generation
from ...web.state import SETTINGS
from ...web.work_pools import THREAD_POOLS

MAX_INPUT_CHARS = 4096
# response_format -> (container, codec, sample rate or None for the voice's, content type)
FORMATS = {
    "mp3": ("mp3", "libmp3lame", None, "audio/mpeg"),
    "opus": ("ogg", "libopus", 48000, "audio/ogg"),
    "aac": ("adts", "aac", None, "audio/aac"),
    "flac": ("flac", "flac", None, "audio/flac"),
    "wav": ("wav", "pcm_s16le", None, "audio/wav"),
    "pcm": (None, None, 24000, "audio/pcm"),
}


def encode(pcm: bytes, rate: int, fmt: str) -> bytes:
    import av

    container, codec, out_rate, _ = FORMATS[fmt]
    out_rate = out_rate or rate
    samples = np.frombuffer(pcm, dtype="<i2")
    frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = rate
    if container is None:  # raw PCM at OpenAI's 24 kHz
        resampler = av.AudioResampler(format="s16", layout="mono", rate=out_rate)
        frames = resampler.resample(frame) + resampler.resample(None)
        return b"".join(f.to_ndarray().astype("<i2").tobytes() for f in frames)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=out_rate, layout="mono")
        resampler = av.AudioResampler(format=stream.format.name, layout="mono", rate=out_rate)
        for f in resampler.resample(frame) + resampler.resample(None):
            out.mux(stream.encode(f))
        out.mux(stream.encode(None))
    return buf.getvalue()


async def create_speech(request: web.Request) -> web.Response:
    f = decode_fields(await read_object(request), SpeechFields)
    slot = resolve_model(request, required(f.model, "model"), (ModelKind.SPEECH,))
    text = required(f.input, "input")
    if not text.strip():
        raise invalid("'input' must not be empty", "input")
    if len(text) > MAX_INPUT_CHARS:
        raise invalid(f"'input' is longer than {MAX_INPUT_CHARS} characters", "input")
    fmt = "mp3" if f.response_format is None else f.response_format
    if fmt not in FORMATS:
        raise invalid(f"'response_format' must be one of {', '.join(FORMATS)}", "response_format")
    req = p.SpeechRequest(
        rid=request["rid"],
        input=text,
        voice=f.voice,
        speed=1.0 if f.speed is None else f.speed,
        timeout_s=request.app[SETTINGS].request_timeout_s,
    )
    async with generation(request, slot, req) as gen:
        done = await gen.finish_event()
    audio = await THREAD_POOLS["speech"].run(encode, done.audio, int(done.sample_rate), fmt)
    return web.Response(body=audio, content_type=FORMATS[fmt][3])
