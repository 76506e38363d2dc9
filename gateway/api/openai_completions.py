"""OpenAI (legacy) Completions: POST /v1/completions."""

from __future__ import annotations

from aiohttp import web
from mlxgw.shared import protocol as p
from mlxgw.shared.errors import invalid

from ..auth import resolve_model
from ..generation import Generation
from . import openai_common as oc
from . import validate as v
from .body import read_json

routes = web.RouteTableDef()


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    """A string, a one-element list of strings, a token list, or a one-element list of those."""
    prompt = v.required(body, "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("batched prompts are not supported; send one prompt per request", "prompt")
    raise invalid("'prompt' must be a string or a list of token ids", "prompt")


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body = v.require_object(await read_json(request))
    model = v.string(body, "model", required_=True)
    slot = resolve_model(request, model)
    text, tokens = _prompt(body)
    oc.check_unsupported(body)
    if body.get("logprobs") is not None:
        raise invalid("logprobs are not supported yet", "logprobs")
    if body.get("suffix"):
        raise invalid("suffix (fill-in-the-middle) is not supported", "suffix")
    echo = v.boolean(body, "echo")
    if echo and text is None:
        raise invalid("echo needs a text prompt", "echo")
    stream, include_usage = oc.stream_options(body)
    req = p.GenerateRequest(
        prompt=text,
        prompt_tokens=tokens,
        max_tokens=oc.max_tokens(request, body, slot.entry, "max_tokens") or 16,
        **oc.base_request(request, body, slot.entry),
    )
    prefix = text if echo else ""
    gen = oc.generation(request, slot, req)
    if stream:
        return await _stream(request, gen, include_usage, prefix)
    async with gen:
        out = await gen.result()
        return web.json_response(
            {
                "id": oc.new_id("cmpl"),
                "object": "text_completion",
                "created": oc.now(),
                "model": slot.name,
                "choices": [
                    {"index": 0, "text": prefix + out.text, "logprobs": None, "finish_reason": out.finish_reason}
                ],
                "usage": oc.usage_dict(out.usage),
            }
        )


async def _stream(request: web.Request, gen: Generation, include_usage: bool, prefix: str) -> web.StreamResponse:
    make = oc.chunk_maker("text_completion", "cmpl", gen.slot.name, include_usage)

    def chunk(text: str, finish: str | None) -> dict:
        return make({"text": text, "finish_reason": finish})

    def deltas(ev: dict) -> list[dict]:
        return [chunk(ev["text"], None)] if ev.get("text") else []

    preamble = [chunk(prefix, None)] if prefix else []
    return await oc.stream_response(request, gen, deltas, lambda reason: chunk("", reason), include_usage, preamble)
