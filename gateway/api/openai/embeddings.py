"""OpenAI Embeddings: POST /v1/embeddings.

The worker returns float32 vectors as raw bytes; `encoding_format: base64` is those bytes
base64-encoded (OpenAI's format, which the official SDK requests by default), `float` is
the same numbers as a JSON list."""

from __future__ import annotations

import array
import base64

from aiohttp import web

from ....shared import protocol as p
from ....shared.errors import invalid
from ....shared.model_sections import ModelKind
from ...pipeline.aux_fields import EmbeddingsFields, required
from ...pipeline.serving import generation, open_fields
from ...pipeline.translate import granted_priority
from ...web.state import SETTINGS

routes = web.RouteTableDef()

MAX_INPUTS = 2048  # OpenAI's limit per request


def _is_tokens(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_inputs(raw) -> list:
    """A string, a list of strings, a token array, or a list of token arrays."""
    required(raw, "input")
    if isinstance(raw, str) or _is_tokens(raw):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) or _is_tokens(x) for x in raw):
        inputs = raw
    else:
        raise invalid(
            "'input' must be a non-empty string, a list of strings, a list of token ids, or a list of such lists",
            "input",
        )
    if len(inputs) > MAX_INPUTS:
        raise invalid(f"'input' takes at most {MAX_INPUTS} entries, got {len(inputs)}", "input")
    for i, x in enumerate(inputs):
        if isinstance(x, str) and not x:
            raise invalid(f"input[{i}] is an empty string", "input")
    return inputs


@routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    f, slot = await open_fields(request, EmbeddingsFields, (ModelKind.EMBEDDING,))
    inputs = parse_inputs(f.input)
    fmt = "float" if f.encoding_format is None else f.encoding_format
    if fmt not in ("float", "base64"):
        raise invalid("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    req = p.EmbedRequest(
        rid=request["rid"],
        inputs=inputs,
        dimensions=f.dimensions,
        timeout_s=request.app[SETTINGS].request_timeout_s,
        priority=granted_priority(request, f.priority or 0),
    )
    async with generation(request, slot, req) as gen:
        done = await gen.finish_event()
    blob, dim = done.vectors, int(done.dim)
    row = dim * 4
    data = []
    for i in range(len(inputs)):
        raw = blob[i * row : (i + 1) * row]
        if fmt == "base64":
            embedding = base64.b64encode(raw).decode()
        else:
            embedding = array.array("f", raw).tolist()
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    tokens = gen.usage.prompt_tokens
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "model": slot.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )
