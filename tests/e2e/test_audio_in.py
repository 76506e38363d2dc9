"""Audio parts into a model that hears them: a real gateway and mlx-vlm worker on the tests' tiny
random Gemma 4 (tests/tiny_audio_model.py: its Conformer audio tower and mlx-vlm's own Gemma 4
processor), voice notes made here as WAV, through the openai SDK and plain HTTP.

What can be checked on random weights: the audio reaches the worker as audio tokens (Gemma 4
hears one token per 40 ms, between two markers, so a second more of audio is 25 tokens more),
streamed and not, as `input_audio` and as an `audio_url` data: URL, in Chat Completions and
Responses; hostile files and audio the model cannot hear are 400s naming why, and the worker
stays as it was."""

from __future__ import annotations

import base64
import io
import math
import wave

import pytest
from helpers import http, openai_client, start_gateway
from helpers.audio_bombs import flac_silence, wav
from helpers.hostile import assert_chat_refused

pytest.importorskip("mlx_vlm", reason="audio-model tests need the vision extra (pip install -e '.[test,vision]')")
pytest.importorskip("av", reason="audio parts are decoded with PyAV (the vision extra)")

CONFIG = {
    "manager": {"auto_discover": False},
    "models": [
        {"name": "tiny-audio", "kind": "vision", "preload": True},
        # the same family without its audio tower, as text-and-image checkpoints ship
        {"name": "tiny-audio-deaf", "kind": "vision"},
    ],
}
TOKENS_PER_SECOND = 25  # Gemma 4: one audio token per 40 ms (rounded up: 0.98 s is 25, 1.98 s 50)


def tone(seconds: float, rate: int = 16000) -> bytes:
    """A 440 Hz tone as a 16-bit mono WAV."""
    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    samples = (np.sin(2 * np.pi * 440 * t) * 8000).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return buf.getvalue()


def declaring(data: bytes, data_bytes: int) -> bytes:
    """The WAV with its RIFF and data chunk sizes claiming `data_bytes` of samples."""
    out = bytearray(data)
    out[4:8] = (36 + data_bytes).to_bytes(4, "little")
    at = out.find(b"data")
    out[at + 4 : at + 8] = data_bytes.to_bytes(4, "little")
    return bytes(out)


def input_audio(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def voice_note(*parts: dict, text: str = "Answer the voice note.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


@pytest.fixture(scope="module")
def gw(home, smollm2_dir):
    from tiny_audio_model import build_tiny_audio_model

    build_tiny_audio_model(home / "models" / "tiny-audio", smollm2_dir)
    build_tiny_audio_model(home / "models" / "tiny-audio-deaf", smollm2_dir, audio=False)
    gw = start_gateway(home, CONFIG, "audio-in-gateway")
    yield gw
    gw.stop()


def test_audio_reaches_the_worker_as_audio_tokens(gw):
    client = openai_client(gw)

    def prompt_tokens(*parts: dict) -> int:
        r = client.chat.completions.create(model="tiny-audio", messages=voice_note(*parts), max_tokens=2)
        assert r.choices[0].finish_reason == "length"
        return r.usage.prompt_tokens

    one, two = prompt_tokens(input_audio(tone(0.98))), prompt_tokens(input_audio(tone(1.98)))
    assert two - one == TOKENS_PER_SECOND
    # a header that declares 37 hours over 0.98 s of samples: heard as what it holds
    assert prompt_tokens(input_audio(declaring(tone(0.98), 0xFFFFFF00))) == one
    # a second part of 1 s: its 25 tokens between its own two markers
    assert prompt_tokens(input_audio(tone(0.98)), input_audio(tone(0.98))) == one + TOKENS_PER_SECOND + 2
    url = f"data:audio/wav;base64,{base64.b64encode(tone(1.98)).decode()}"
    assert prompt_tokens({"type": "audio_url", "audio_url": {"url": url}}) == two
    stream = client.chat.completions.create(
        model="tiny-audio",
        messages=voice_note(input_audio(tone(1.98))),
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens == two and chunks[-1].usage.completion_tokens == 3
    r = client.responses.create(
        model="tiny-audio",
        input=[
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "Answer the voice note."}, input_audio(tone(1.98))],
            }
        ],
        max_output_tokens=2,
    )
    assert r.usage.input_tokens == two


def test_voice_notes_of_different_lengths_share_a_batch(gw):
    """Rows prefilled together: the processor's mel features differ in length per note and are
    the audio tower's input only; none may be batched into the language model's arguments."""
    from concurrent.futures import ThreadPoolExecutor

    client = openai_client(gw)
    pid = gw.worker_pid("tiny-audio")
    notes = [None, 0.5, 0.98, 1.46, 1.98]  # and a text-only row beside them

    def ask(seconds):
        parts = [] if seconds is None else [input_audio(tone(seconds))]
        r = client.chat.completions.create(model="tiny-audio", messages=voice_note(*parts), max_tokens=3)
        return r.usage.prompt_tokens

    with ThreadPoolExecutor(len(notes)) as pool:
        counts = list(pool.map(ask, notes))
    text_only = counts[0]
    assert counts[1:] == [text_only + 2 + math.ceil(s * TOKENS_PER_SECOND) for s in notes[1:]], counts
    assert gw.worker_pid("tiny-audio") == pid


HOSTILE = [
    (tone(0.98)[:30], "could not be decoded as audio"),  # cut off inside its header
    (flac_silence(40 * 60), "from its header"),  # 40 minutes of silence in a small FLAC: over the cap
    (b"this is no audio at all" * 10, "could not be decoded as audio"),
    (wav(rate=1, samples=100), "sample rate of 1 Hz"),
    (tone(31.0), "this model hears at most 30 seconds"),  # Gemma 4 hears 750 tokens of 40 ms
]


@pytest.mark.parametrize("data,message", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_audio_is_a_400_and_the_worker_lives(gw, data, message):
    body = {"model": "tiny-audio", "messages": voice_note(input_audio(data)), "max_tokens": 2}
    assert_chat_refused(gw, body, message, watched="tiny-audio")


def test_a_checkpoint_without_its_audio_tower_refuses_audio_by_name(gw):
    status, _, body = http(
        f"{gw.url}/v1/chat/completions",
        "POST",
        {"model": "tiny-audio-deaf", "messages": voice_note(input_audio(tone(0.98))), "max_tokens": 2},
    )
    assert status == 400, body
    assert "does not accept audio (its checkpoint has no audio encoder)" in body["error"]["message"], body
    assert "chat.audio_model" in body["error"]["message"]
