"""Image inputs: a real mlx-vlm worker (a tiny random-weight Qwen2-VL the tests build, with
mlx-vlm's own image processor) behind a real gateway, through the openai and anthropic SDKs.

A random-weight model says nothing sensible about an image, so the tests check what can be
checked: the image reaches the worker (its image tokens are in the prompt count, the worker
counts it), answers complete in every API and in streams, bad images are clear 400s, and
the worker survives them."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import pytest
from helpers import async_openai_client, http, openai_client, start_gateway
from helpers.hostile import assert_chat_refused
from helpers.usage import prompt_total

pytest.importorskip("mlx_vlm", reason="vision tests need the vision extra (pip install -e '.[test,vision]')")

from PIL import Image  # noqa: E402  (after the skip: Pillow comes with the vision extra)

MAX_IMAGE_MB = 0.05  # a small limit, so the too-large case stays cheap

VISION_CONFIG = {
    "manager": {"auto_discover": False},
    "models": [
        {"name": "tiny-vision", "kind": "vision", "preload": True, "aliases": ["gpt-4o"]},
        {"name": "tiny", "source": "tiny"},
    ],
}


@pytest.fixture(scope="module")
def gw(home, tiny_vision_dir, tiny_dir):
    gw = start_gateway(home, VISION_CONFIG, "vision-gateway", extra_args=("--max-image-mb", str(MAX_IMAGE_MB)))
    yield gw
    gw.stop()


def png(width=64, height=48, color=(200, 30, 30), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, fmt)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat_with_image(url: str, text="What is in this image?") -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}
    ]


def images_seen(gw, previous: int = -1, timeout: float = 10) -> int:
    """The worker's image counter (from heartbeats), once it has moved past `previous`."""
    deadline = time.monotonic() + timeout
    while True:
        workers = [w for w in gw.model_status("tiny-vision")["workers"] if w["state"] == "ready"]
        seen = (workers[0]["stats"] if workers else {}).get("images_seen", -1)
        if seen > previous or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


# -- images reach the worker in every API -------------------------------------------------


def test_openai_image_url_reaches_the_vision_worker(gw):
    client = openai_client(gw)
    before = images_seen(gw)
    text_only = client.chat.completions.create(
        model="tiny-vision", messages=[{"role": "user", "content": "What is in this image?"}], max_tokens=4
    )
    with_image = client.chat.completions.create(
        model="gpt-4o", messages=chat_with_image(data_url(png())), max_tokens=4, temperature=0
    )
    assert with_image.choices[0].finish_reason == "length"
    assert with_image.usage.completion_tokens == 4
    # the image became vision tokens in the prompt: start, end and at least one patch token
    assert with_image.usage.prompt_tokens >= text_only.usage.prompt_tokens + 3
    assert images_seen(gw, before) == before + 1


def test_openai_stream_and_jpeg(gw):
    stream = openai_client(gw).chat.completions.create(
        model="tiny-vision",
        messages=chat_with_image(data_url(png(fmt="JPEG"), "image/jpeg")),
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)


def test_anthropic_image_block(gw):
    import anthropic

    client = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    msg = client.messages.create(
        model="tiny-vision",
        max_tokens=4,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": b64(png()),
                        },
                    },
                    {"type": "text", "text": "Describe the image."},
                ],
            }
        ],
    )
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 4
    count = client.messages.count_tokens(
        model="tiny-vision",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Describe the image."}]}],
    )
    assert prompt_total(msg.usage) >= count.input_tokens + 3


def test_anthropic_tool_result_image_reaches_the_vision_worker(gw):
    """Claude Code's Read tool on a PNG: the image in the tool_result goes to the model."""
    import anthropic

    client = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}

    def send(result: list[dict]):
        turns = [
            {"role": "user", "content": "Read a.png"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]},
        ]
        return client.messages.with_raw_response.create(model="tiny-vision", max_tokens=2, messages=turns)

    text = {"type": "text", "text": "a.png:"}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(png())}}
    with_image, text_only = send([text, image]), send([text])
    assert "x-mlxgw-omitted-content" not in with_image.headers

    # the image became vision tokens in the prompt: start, end and at least one patch token
    assert prompt_total(with_image.parse().usage) >= prompt_total(text_only.parse().usage) + 3


def test_responses_input_image(gw):
    r = openai_client(gw).responses.create(
        model="tiny-vision",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": data_url(png()), "detail": "auto"},
                ],
            }
        ],
        max_output_tokens=3,
    )
    assert r.status == "incomplete" and r.usage.output_tokens == 3


def test_seeded_requests_repeat_inside_a_batch(gw):
    """mlx-vlm draws every row with one sampler; a seed still gives the same tokens."""

    async def run():
        client = async_openai_client(gw)
        try:
            jobs = [
                client.chat.completions.create(
                    model="tiny-vision",
                    messages=chat_with_image(data_url(png())),
                    max_tokens=8,
                    temperature=1.0,
                    seed=seed,
                )
                for seed in (7, 7, 8, 7)
            ]
            return [r.choices[0].message.content for r in await asyncio.gather(*jobs)]
        finally:
            await client.close()

    a, b, c, d = asyncio.run(run())
    assert a == b == d and a != c


def test_image_and_text_requests_share_the_batch(gw):
    async def run():
        client = async_openai_client(gw)
        try:
            jobs = []
            for i in range(6):
                if i % 2:
                    messages = [{"role": "user", "content": f"Say something about number {i}."}]
                else:
                    messages = chat_with_image(data_url(png(color=(i * 40, 100, 50))))
                jobs.append(client.chat.completions.create(model="tiny-vision", messages=messages, max_tokens=6))
            return await asyncio.gather(*jobs)
        finally:
            await client.close()

    results = asyncio.run(run())
    assert all(r.usage.completion_tokens == 6 for r in results)


# -- bad images -----------------------------------------------------------------------------

BAD_IMAGES = [
    ("data:image/png;base64,!!!not base64!!!", "not valid base64"),
    ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "unsupported image type"),
    (data_url(b"GIF89a this is not really a gif"[:4] + b"xx", "image/gif"), "not a PNG"),
    (data_url(b"just some bytes that are no image"), "not a PNG"),
    (data_url(png()[:40]), "could not be decoded"),  # a PNG signature with a cut-off body
    (data_url(png(600, 600, fmt="BMP"), "image/bmp"), "limit is"),  # over --max-image-mb
    (data_url(png(2000, 2)), "could not be prepared"),  # decodes, but the processor refuses it
    ("data:image/png," + "x" * 10, "base64"),
    ("https://example.com/cat.png", "not fetched by this server"),
    ("file:///etc/passwd", "must be a data: URL"),
]


@pytest.mark.parametrize("url,message", BAD_IMAGES, ids=range(len(BAD_IMAGES)))
def test_bad_images_are_clear_400s_and_the_worker_lives(gw, url, message):
    body = {"model": "tiny-vision", "messages": chat_with_image(url), "max_tokens": 2}
    assert_chat_refused(gw, body, message, watched="tiny-vision")


def test_bad_anthropic_images(gw):
    def send(source):
        block = {"type": "image", "source": source}
        return http(
            f"{gw.url}/v1/messages",
            "POST",
            {"model": "tiny-vision", "max_tokens": 2, "messages": [{"role": "user", "content": [block]}]},
        )

    for source, message in [
        ({"type": "base64", "media_type": "image/png", "data": "%%%"}, "not valid base64"),
        ({"type": "base64", "media_type": "image/tiff", "data": b64(png())}, "unsupported"),
        ({"type": "base64", "media_type": "image/png", "data": b64(png()[:40])}, "decoded"),
        ({"type": "file", "file_id": "f_1"}, "'base64' or 'url'"),
        ({"type": "base64", "media_type": "image/bmp", "data": b64(png(600, 600, fmt="BMP"))}, "limit is"),
        ({"type": "url", "url": "https://example.com/cat.png"}, "not fetched by this server"),
    ]:
        status, _, body = send(source)
        assert status == 400 and body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error" and message in body["error"]["message"], body


def test_text_models_refuse_images_in_both_apis(gw):
    status, _, body = http(
        f"{gw.url}/v1/chat/completions", "POST", {"model": "tiny", "messages": chat_with_image(data_url(png()))}
    )
    assert status == 400 and "does not accept images" in body["error"]["message"]
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    status, _, body = http(
        f"{gw.url}/v1/messages",
        "POST",
        {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [block]}]},
    )
    assert status == 400 and body["type"] == "error" and "does not accept images" in body["error"]["message"]


# -- URL fetching (off by default; when on, never to this machine or its network) -------------


async def test_url_fetching_refuses_non_public_addresses(aiohttp_server):
    """In-process, against a real HTTP server on 127.0.0.1 that would serve the image."""
    from aiohttp import web

    from mlxgw.gateway.pipeline.images import ImageLimits, PublicOnlyResolver, collect_images, from_url
    from mlxgw.shared.errors import ServiceError

    async def image(request):
        return web.Response(body=png(), content_type="image/png")

    app = web.Application()
    app.router.add_get("/cat.png", image)
    server = await aiohttp_server(app)
    limits = ImageLimits(allow_urls=True)
    for url in (
        f"http://127.0.0.1:{server.port}/cat.png",
        f"http://localhost:{server.port}/cat.png",
        "http://10.0.0.1/cat.png",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]/cat.png",
        "http://[::ffff:127.0.0.1]/cat.png",
    ):
        messages = [{"role": "user", "content": [from_url(url, "messages[0]", limits)]}]
        with pytest.raises(ServiceError) as err:
            await collect_images(messages, limits)
        assert err.value.status == 400 and "not fetched" in err.value.message, url
    with pytest.raises(OSError):
        await PublicOnlyResolver().resolve("localhost", server.port)
