"""Video and audio inputs: a real gateway and mlx-vlm worker (the tests' tiny random Qwen2-VL, its video
processor configured for tiny frames), clips made here with PyAV, through the openai SDK and
plain HTTP in every chat API.

What can be checked on random weights: the clip reaches the worker as video tokens (56x56
frames are 2x2 merged patches, 2 tokens a frame, so the prompt grows by 2 tokens per sampled
frame), `video_fps` and `video_max_frames` choose how many, streams and answers agree, and
hostile files are 400s that leave the worker as it was. Audio parts: transcribed by Whisper
for the text model whose entry names it (chat.audio_model), refused by name elsewhere."""

from __future__ import annotations

import base64

import pytest
from helpers import DATA, http, openai_client, start_gateway, wait_for
from helpers.audio_bombs import wav
from helpers.hostile import assert_chat_refused

pytest.importorskip("mlx_vlm", reason="video tests need the vision extra (pip install -e '.[test,vision]')")
pytest.importorskip("av", reason="video tests make their clips with PyAV (the vision extra)")

from helpers.media import declaring_frames, mp4, video_url  # noqa: E402  (PyAV: after the skip)

IMAGE_ONLY = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% else %}{% for part in message.content %}"
    "{% if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONFIG = {
    "manager": {"auto_discover": False},
    "models": [
        {"name": "tiny-vision", "kind": "vision", "preload": True},
        {"name": "tiny", "source": "tiny", "chat": {"audio_model": "whisper-tiny-en"}},
        {"name": "tiny-deaf", "source": "tiny"},
        # The same vision model with a chat template that places images only (as LLaVA-style
        # templates do): it cannot take video, and says so.
        {"name": "tiny-stills", "kind": "vision", "source": "tiny-vision", "chat": {"chat_template": IMAGE_ONLY}},
        {"name": "whisper-tiny-en", "kind": "audio"},
    ],
}
CLIP = mp4()  # 3 s, 30 frames at 10 a second: 6 frames sampled at the default 2 a second
TOKENS_PER_FRAME = 2


@pytest.fixture(scope="module")
def gw(home, tiny_vision_dir, tiny_dir, whisper_tiny_dir):
    gw = start_gateway(home, CONFIG, "media-gateway")
    yield gw
    gw.stop()


def chat_with_video(url: str, text: str = "What happens in this clip?") -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "text", "text": text}, {"type": "video_url", "video_url": {"url": url}}]}
    ]


def _stats(gw) -> dict:
    workers = [w for w in gw.model_status("tiny-vision")["workers"] if w["state"] == "ready"]
    return workers[0].get("stats") or {}


def test_video_frames_reach_the_worker_as_video_tokens(gw):
    client = openai_client(gw)

    def prompt_tokens(**fields) -> int:
        r = client.chat.completions.create(
            model="tiny-vision", messages=chat_with_video(video_url(CLIP)), max_tokens=2, extra_body=fields
        )
        assert r.choices[0].finish_reason == "length"
        return r.usage.prompt_tokens

    six = prompt_tokens()
    four = prompt_tokens(video_max_frames=4)
    twelve = prompt_tokens(video_fps=4, video_max_frames=12)
    assert (six - four, twelve - six) == (2 * TOKENS_PER_FRAME, 6 * TOKENS_PER_FRAME)
    stream = client.chat.completions.create(
        model="tiny-vision",
        messages=chat_with_video(video_url(CLIP)),
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens == six and chunks[-1].usage.completion_tokens == 3
    # the worker's counters (from its heartbeats): four videos, each frame sampled once
    wait_for(lambda: _stats(gw).get("videos_seen", 0) >= 4)
    assert _stats(gw)["video_frames_seen"] >= 6 + 4 + 12 + 6


def test_video_in_responses_anthropic_and_ollama(gw):
    client = openai_client(gw)
    chat = client.chat.completions.create(model="tiny-vision", messages=chat_with_video(video_url(CLIP)), max_tokens=2)
    text = "What happens in this clip?"
    r = client.responses.create(
        model="tiny-vision",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": text},
                    {"type": "input_video", "video_url": video_url(CLIP)},
                ],
            }
        ],
        max_output_tokens=2,
    )
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    b64 = base64.b64encode(CLIP).decode()
    block = {"type": "video", "source": {"type": "base64", "media_type": "video/mp4", "data": b64}}
    status, _, body = http(
        f"{gw.url}/v1/messages",
        "POST",
        {
            "model": "tiny-vision",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}, block]}],
        },
    )
    assert status == 200, body
    assert body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"] == chat.usage.prompt_tokens
    status, _, body = http(
        f"{gw.url}/api/chat",
        "POST",
        {
            "model": "tiny-vision",
            "stream": False,
            "options": {"num_predict": 2, "video_max_frames": 4},
            "messages": [{"role": "user", "content": text, "images": [b64]}],
        },
    )
    assert status == 200, body
    assert body["prompt_eval_count"] == chat.usage.prompt_tokens - 2 * TOKENS_PER_FRAME


def test_a_second_turn_about_the_same_video_reads_it_from_the_cache(gw):
    """The first turn's blocks, video tokens included, are found by the second turn (mlx-vlm's
    prefix cache keyed by the frames' content) and the vision tower does not run again; the
    same words about another clip find nothing."""
    client = openai_client(gw)
    # The cache holds whole blocks of 16 tokens, and a block is reused only past the last video
    # token: the question after the clip fills the block the clip ends in.
    question = "What happens in this recording, step by step, and what should a new viewer notice first?"

    def ask(clip: bytes) -> list[dict]:
        video = {"type": "video_url", "video_url": {"url": video_url(clip)}}
        return [{"role": "user", "content": [video, {"type": "text", "text": question}]}]

    first = ask(CLIP)
    one = client.chat.completions.create(model="tiny-vision", messages=first, max_tokens=2)
    skipped = _stats(gw)["cache"].get("media_encodes_skipped", 0)
    second = [*first, {"role": "assistant", "content": "A bar grows."}, {"role": "user", "content": "And then?"}]
    two = client.chat.completions.create(model="tiny-vision", messages=second, max_tokens=2)
    video_tokens = 6 * TOKENS_PER_FRAME
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens - 16 > video_tokens, two.usage
    wait_for(lambda: _stats(gw)["cache"].get("media_encodes_skipped", 0) > skipped)
    other = ask(mp4(frames=20))
    other_two = [*other, {"role": "assistant", "content": "A bar grows."}, {"role": "user", "content": "And then?"}]
    three = client.chat.completions.create(model="tiny-vision", messages=other_two, max_tokens=2)
    assert not (three.usage.prompt_tokens_details and three.usage.prompt_tokens_details.cached_tokens)


HOSTILE = [
    (video_url(CLIP[: len(CLIP) // 2]), "could not be read"),  # cut off before its index
    (video_url(mp4(frames=30, faststart=True)[:1500]), "could not be read"),  # its index, then half the frames
    (video_url(declaring_frames(CLIP, 1_000_000)), "declares 1,000,000 frames"),
    (video_url(b"\0\0\0\x20ftypisom" + bytes(2000)), "could not be read"),  # a signature, then nothing
    (video_url(b"\x89PNG\r\n\x1a\n" + bytes(100)), "not an MP4"),
    ("data:video/mp4;base64,@@@", "not valid base64"),
    ("https://example.com/clip.mp4", "not fetched by this server"),
]


@pytest.mark.parametrize("url,message", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_videos_are_400s_and_the_worker_lives(gw, url, message):
    body = {"model": "tiny-vision", "messages": chat_with_video(url), "max_tokens": 2}
    assert_chat_refused(gw, body, message, watched="tiny-vision")


def test_a_vision_model_whose_template_places_no_video_refuses_it(gw):
    status, _, body = http(
        f"{gw.url}/v1/chat/completions",
        "POST",
        {"model": "tiny-stills", "messages": chat_with_video(video_url(CLIP)), "max_tokens": 2},
    )
    assert status == 400 and "cannot take video" in body["error"]["message"], body


def test_text_models_refuse_video_in_every_api(gw):
    url = video_url(CLIP)
    status, _, body = http(
        f"{gw.url}/v1/chat/completions",
        "POST",
        {"model": "tiny-deaf", "messages": chat_with_video(url), "max_tokens": 2},
    )
    assert status == 400 and "does not accept video" in body["error"]["message"], body
    status, _, body = http(
        f"{gw.url}/v1/responses",
        "POST",
        {"model": "tiny-deaf", "input": [{"role": "user", "content": [{"type": "input_video", "video_url": url}]}]},
    )
    assert status == 400 and "does not accept video" in body["error"]["message"], body
    block = {"type": "video", "source": {"type": "base64", "media_type": "video/mp4", "data": url.split(",", 1)[1]}}
    status, _, body = http(
        f"{gw.url}/v1/messages",
        "POST",
        {"model": "tiny-deaf", "max_tokens": 2, "messages": [{"role": "user", "content": [block]}]},
    )
    assert status == 400 and "does not accept video" in body["error"]["message"], body
    ollama = {
        "model": "tiny-deaf",
        "stream": False,
        "messages": [{"role": "user", "content": "?", "images": [url.split(",", 1)[1]]}],
    }
    status, _, body = http(f"{gw.url}/api/chat", "POST", ollama)
    assert status == 400 and "does not accept images or video" in body["error"], body


# -- audio parts ----------------------------------------------------------------------------

FOX = (DATA / "audio" / "fox.wav").read_bytes()  # "The quick brown fox jumps over the lazy dog."


def chat_with_audio(data: bytes, text: str = "Answer the voice note.") -> list[dict]:
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}
    return [{"role": "user", "content": [{"type": "text", "text": text}, audio]}]


def test_audio_is_transcribed_for_a_text_model_that_names_a_transcriber(gw):
    status, headers, body = http(
        f"{gw.url}/v1/chat/completions", "POST", {"model": "tiny", "messages": chat_with_audio(FOX), "max_tokens": 2}
    )
    assert status == 200, body
    assert headers["x-mlxgw-transcribed-content"] == "audio"
    text_only = openai_client(gw).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Answer the voice note."}], max_tokens=2
    )
    # the transcript ("[audio transcript] The quick brown fox ...") is in the prompt
    assert body["usage"]["prompt_tokens"] >= text_only.usage.prompt_tokens + 10


BAD_AUDIO = [
    (wav(rate=1, samples=100), "tiny", "sample rate of 1 Hz"),  # a header rate that makes decoding a bomb
    (b"this is no audio at all" * 10, "tiny", "could not be decoded as audio"),
    (FOX, "tiny-deaf", "an operator can set chat.audio_model"),
    (FOX, "tiny-vision", "does not accept audio"),  # Qwen2-VL's processor reads no audio
]


@pytest.mark.parametrize("data,model,message", BAD_AUDIO, ids=range(len(BAD_AUDIO)))
def test_audio_refusals_are_clear_400s(gw, data, model, message):
    body = {"model": model, "messages": chat_with_audio(data), "max_tokens": 2}
    assert_chat_refused(gw, body, message, watched="tiny-vision")


def test_responses_refuses_audio_for_a_model_without_a_transcriber(gw):
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(FOX).decode(), "format": "wav"}}
    status, _, body = http(
        f"{gw.url}/v1/responses", "POST", {"model": "tiny-deaf", "input": [{"role": "user", "content": [audio]}]}
    )
    assert status == 400 and "an operator can set chat.audio_model" in body["error"]["message"], body
