"""Images out: OpenAI's Images API on a `kind: image` worker (a tiny random-weight Z-Image the
tests build with mlx-vlm's own classes) behind a real gateway, through the openai SDK.

Random weights draw noise, so the tests check what can be checked: PNGs of the requested
size come back (and through a stream), an edit keeps the source where its mask is opaque,
refusals are 400s in OpenAI's shape, and the ledger counts the images."""

from __future__ import annotations

import base64
import io
import sqlite3
import threading

import pytest
from helpers import cancel_request, http, openai_client, start_gateway, wait_for

pytest.importorskip("mlx_vlm", reason="image tests need the vision extra (pip install -e '.[test,vision]')")

import openai  # noqa: E402
from PIL import Image  # noqa: E402  (after the skip: Pillow comes with the vision extra)

CONFIG = {
    "manager": {"auto_discover": False},
    "models": [
        {"name": "tiny-image", "kind": "image"},  # loaded by its first request, like any model
        {"name": "tiny", "source": "tiny"},
    ],
}
FAST = {"steps": 2}  # mlx-vlm's extra: two denoising steps


@pytest.fixture(scope="module")
def gw(home, smollm2_dir, tiny_dir):
    from tiny_image_model import build_tiny_image_model

    build_tiny_image_model(home / "models" / "tiny-image", smollm2_dir)
    gw = start_gateway(home, CONFIG, "images-gateway")
    yield gw
    gw.stop()


def png_of(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return image


def test_generate_returns_pngs_of_the_requested_size_and_the_ledger_counts_them(gw, home):
    client = openai_client(gw)
    result = client.images.generate(model="tiny-image", prompt="a red barn", size="64x48", n=2, extra_body=FAST)
    assert [png_of(d.b64_json).size for d in result.data] == [(64, 48), (64, 48)]
    assert result.size == "64x48"

    def rows():
        with sqlite3.connect(home / "usage.db") as conn:
            q = "SELECT images, status FROM requests WHERE model = 'tiny-image' AND api = '/v1/images/generations'"
            return conn.execute(q).fetchall()

    assert wait_for(rows, timeout=10) == [(2, 200)]


def test_stream_sends_each_image_as_a_completed_event(gw):
    stream = openai_client(gw).images.generate(
        model="tiny-image", prompt="a boat", size="32x32", stream=True, partial_images=1, extra_body=FAST
    )
    events = list(stream)
    assert [e.type for e in events] == ["image_generation.completed"]
    assert png_of(events[0].b64_json).size == (32, 32)


def test_edit_keeps_the_source_where_the_mask_is_opaque(gw):
    source = Image.new("RGB", (64, 48), (200, 30, 30))
    mask = Image.new("RGBA", (64, 48), (0, 0, 0, 0))  # transparent: may change
    mask.paste((0, 0, 0, 255), (0, 0, 32, 48))  # the left half opaque: kept
    files = []
    for image in (source, mask):
        buf = io.BytesIO()
        image.save(buf, "PNG")
        files.append(("image.png", buf.getvalue(), "image/png"))
    result = openai_client(gw).images.edit(
        model="tiny-image", image=files[0], mask=files[1], prompt="make it blue", extra_body=FAST
    )
    edited = png_of(result.data[0].b64_json).convert("RGB")
    assert edited.size == (64, 48)  # no size: the source's
    left = {edited.getpixel((x, y)) for x in range(32) for y in range(48)}
    assert left == {(200, 30, 30)}
    assert edited.crop((32, 0, 64, 48)).getcolors(64 * 48) != [(32 * 48, (200, 30, 30))]


@pytest.mark.parametrize(
    "change, param",
    [
        ({"size": "100x100"}, "size"),
        ({"size": "big"}, "size"),
        ({"size": "4096x4096"}, "size"),
        ({"n": 0}, "n"),
        ({"n": 11}, "n"),
        ({"response_format": "url"}, "response_format"),
        ({"prompt": ""}, "prompt"),
        ({"model": "tiny"}, "model"),
    ],
)
def test_bad_requests_are_400s_in_openai_shape(gw, change, param):
    body = {"model": "tiny-image", "prompt": "a cat", "size": "32x32", **change}
    status, _, reply = http(f"{gw.url}/v1/images/generations", "POST", body)
    assert status == 400, reply
    assert reply["error"]["param"] == param
    assert reply["error"]["type"] == "invalid_request_error"
    if param == "response_format":
        assert "does not host" in reply["error"]["message"] and "b64_json" in reply["error"]["message"]
    if param == "model":  # a chat model: which route serves it
        assert "chat model" in reply["error"]["message"] and "/v1/chat/completions" in reply["error"]["message"]


def test_the_sdk_sees_a_chat_model_refused(gw):
    with pytest.raises(openai.BadRequestError, match="chat model"):
        openai_client(gw).images.generate(model="tiny", prompt="a cat", size="32x32")


def test_an_image_model_named_in_chat_is_refused_with_its_route(gw):
    body = {"model": "tiny-image", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, _, reply = http(f"{gw.url}/v1/chat/completions", "POST", body)
    assert status == 400
    assert "an image model" in reply["error"]["message"] and "/v1/images/generations" in reply["error"]["message"]


def test_a_cancel_lands_between_images_and_the_worker_serves_on(gw):
    """Ten 128x128 images take seconds each here: a cancel after the first stops the rest (the
    one being drawn finishes on the model's thread), and the same worker serves the next."""
    client = openai_client(gw, timeout=120)
    ended = {}

    def ask():
        try:
            client.images.generate(
                model="tiny-image", prompt="a long job", size="128x128", n=10, extra_body=FAST,
                extra_headers={"x-request-id": "img-cancel"},
            )  # fmt: skip
        except openai.APIError as e:
            ended["error"] = e

    def worker() -> dict:
        return next(w for w in gw.model_status("tiny-image")["workers"] if w["state"] == "ready")

    thread = threading.Thread(target=ask)
    thread.start()
    wait_for(lambda: any(r.get("images", 0) >= 1 for r in worker()["stats"]["requests"]), timeout=60)
    pid, drawn = worker()["pid"], worker()["stats"]["images"]
    assert cancel_request(gw, "img-cancel") == 200
    thread.join(timeout=60)
    assert "error" in ended  # the client was told it ended
    wait_for(lambda: not worker()["stats"]["requests"] and worker()["stats"]["running"] == 0, timeout=30)
    result = client.images.generate(model="tiny-image", prompt="next", size="32x32", extra_body=FAST)
    assert png_of(result.data[0].b64_json).size == (32, 32)
    assert worker()["pid"] == pid
    # The next request's one image aside, the cancelled job drew the ones in flight while the
    # cancel travelled (more on a loaded host), never its remaining nine.
    assert worker()["stats"]["images"] - drawn - 1 < 8
