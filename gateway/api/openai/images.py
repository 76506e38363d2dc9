"""OpenAI Images: POST /v1/images/generations and /v1/images/edits on `kind: image` workers
(mlx-vlm's image models: worker/model/image/runner.py).

Images come back as `b64_json` only: the gateway hosts no files, so `response_format: url`
is a 400 that says so. An edit takes one `image` and an optional `mask` (a PNG whose
transparent pixels mark what may change; elsewhere the source is kept). `stream: true` sends
OpenAI's `image_generation.completed` (`image_edit.completed`) event per image, with SSE
keep-alives while they are drawn: mlx-vlm's pipelines give no partial images, so
`partial_images` is accepted and none are sent, as OpenAI allows. A slow host is never a
timeout: the worker reports each image and a heartbeat-like progress event every few
seconds, which is what the gateway's silence bound waits for; the length of a generation
is not bounded (a client that leaves cancels it between images)."""

from __future__ import annotations

import base64
import time

from aiohttp import web

from ....shared import protocol as p
from ....shared.errors import ErrorCode, ServiceError, invalid
from ....shared.events import Error, Finish
from ....shared.model_sections import ModelKind
from ...access.auth import resolve_model
from ...models.generation import raise_for
from ...pipeline.body import read_object
from ...pipeline.fields import decode_fields
from ...pipeline.serving import generation
from ...web.errors import openai_error_body
from ...web.sse import SSEWriter
from ...web.state import SETTINGS
from ...web.work_pools import THREAD_POOLS
from .image_fields import DEFAULT_SIZE, ImageAsk, ImageFields, check, prepare_edit, read_edit_form

routes = web.RouteTableDef()


@routes.post("/v1/images/generations")
async def generations(request: web.Request) -> web.StreamResponse:
    ask = check(decode_fields(await read_object(request), ImageFields))
    slot = resolve_model(request, ask.model, (ModelKind.IMAGE,))
    width, height = ask.size or DEFAULT_SIZE
    return await _serve(request, slot, ask, _request(request, ask, width, height), "image_generation")


@routes.post("/v1/images/edits")
async def edits(request: web.Request) -> web.StreamResponse:
    text, images, mask = await read_edit_form(request)
    ask = check(decode_fields(text, ImageFields))
    slot = resolve_model(request, ask.model, (ModelKind.IMAGE,))
    if len(images) != 1:
        why = "missing required parameter: 'image'" if not images else "one 'image' per edit is served here"
        raise invalid(why, "image")
    source, mask_png, (width, height) = await THREAD_POOLS["image"].run(prepare_edit, images[0], mask, ask.size)
    req = _request(request, ask, width, height)
    req.image, req.mask = source, mask_png
    return await _serve(request, slot, ask, req, "image_edit")


def _request(request: web.Request, ask: ImageAsk, width: int, height: int) -> p.ImageRequest:
    return p.ImageRequest(
        rid=request["rid"],
        prompt=ask.prompt,
        n=ask.n,
        width=width,
        height=height,
        steps=ask.steps,
        guidance=ask.guidance,
        seed=ask.seed,
        timeout_s=None,  # unbounded length: the gateway's bound is on silence (see above)
    )


async def _serve(request: web.Request, slot, ask: ImageAsk, req: p.ImageRequest, kind: str) -> web.StreamResponse:
    gen = generation(request, slot, req)
    if ask.stream:
        return await _stream(request, gen, req, kind)
    async with gen:
        done = await _finish(gen)
    pngs = done.images or []
    request["images"] = len(pngs)  # the ledger's count (gateway/access/ledger.py)
    data = await THREAD_POOLS["image"].run(_b64_all, pngs)
    body = {
        "created": int(time.time()),
        "data": [{"b64_json": b, "revised_prompt": None} for b in data],
        "size": f"{req.width}x{req.height}",
        "output_format": "png",
    }
    return web.json_response(body)


async def _finish(gen, on_idle=None) -> Finish:
    """The finish event; progress and keep-alive ticks run on_idle (a stream's comment)."""
    async for event in gen.events():
        if type(event) is Finish or type(event) is Error:
            raise_for(event)
            return event
        if on_idle is not None:
            await on_idle()
    raise ServiceError(ErrorCode.INTERNAL, "the request ended without a finish event")


def _b64_all(pngs: list[bytes]) -> list[str]:
    return [base64.b64encode(png).decode("ascii") for png in pngs]


async def _stream(request: web.Request, gen, req: p.ImageRequest, kind: str) -> web.StreamResponse:
    sse = SSEWriter(request, request.app[SETTINGS].write_timeout_s)
    gen.on_wait = sse.comment  # keep-alives while the model loads
    try:
        async with gen:
            await sse.open()
            done = await _finish(gen, on_idle=sse.comment)
        pngs = done.images or []
        for b64 in await THREAD_POOLS["image"].run(_b64_all, pngs):
            event = {
                "type": f"{kind}.completed",
                "b64_json": b64,
                "created_at": int(time.time()),
                "size": f"{req.width}x{req.height}",
                "output_format": "png",
                "quality": "auto",
                "background": "opaque",
            }
            await sse.data(event, event=event["type"])
            request["images"] = request.get("images", 0) + 1
    except ServiceError as err:
        if not sse.opened:
            raise
        await sse.error(openai_error_body(err), event="error")
    await sse.close()
    return sse.response
