"""One generating request, start to end: `handle` runs an `ApiFamily` through the same steps
for every API (as SGLang's OpenAIServingBase runs validate, convert, stream-or-answer):

    read and decode the body once (the family's `Fields`: every field, `model` included)
    → the model it names, and whether this key may use it
    → `parse`: the fields as the one internal request (translate.ParsedRequest)
    → the generation (translate.build_request, then `generation`)
    → a stream of the family's `Emitter` events (stream.run_stream), or `render`'s one body.

A family writes only its own steps, in its own module under gateway/api/; the steps around
them are here once. A family whose request does more than generate once (the MCP tool loop,
llama.cpp's cut of the middle, Ollama's keep_alive) overrides `respond` or `answer` and
calls back into these."""

from __future__ import annotations

from typing import ClassVar, Generic, TypeVar

import msgspec
from aiohttp import web

from ...shared import protocol as p
from ...shared.errors import invalid
from ...shared.model_sections import CHAT_KINDS, ModelKind
from ..access.auth import reserve_tokens, resolve_model
from ..models.generation import Generation, Outcome
from ..web.sse import SSEWriter
from ..web.state import MANAGER, SETTINGS
from .body import read_object
from .cache_hints import session_id
from .fields import ModelField, decode_fields
from .fim_support import file_identity, superseding
from .stream import Emitter, run_stream
from .tracing import SPAN, trace_generation
from .translate import ParsedRequest, build_request

F = TypeVar("F", bound=msgspec.Struct)
M = TypeVar("M", bound=ModelField)


class ApiFamily(Generic[F]):
    """One generating API: its `Fields` (the body's struct), `parse` (fields → the one internal
    request), its `Emitter` (stream events in its shape) and `render` (the answer not streamed).
    One instance serves one request, so what parse learns for the answer (whether a stream
    ends with usage, the tools it offered) is kept on it."""

    Fields: ClassVar[type[msgspec.Struct]]
    Emitter: ClassVar[type[Emitter]] = Emitter
    kinds: ClassVar[tuple[ModelKind, ...]] = CHAT_KINDS  # the model kinds it serves
    writer: ClassVar[type[SSEWriter]] = SSEWriter  # the stream's wire format
    # An editor's keystrokes: a newer FIM request for the same file ends the older (/infill).
    supersedes: ClassVar[bool] = False

    def __init__(self, request: web.Request, body: dict):
        self.request = request
        self.body = body  # as sent (Responses echoes it)
        self.slot = None  # the model, once resolved
        self.headers: dict[str, str] = {}  # the response's own headers, set by parse

    # -- the family's own steps --------------------------------------------------------------

    def model_name(self, fields: F) -> str | None:
        return fields.model

    def resolve(self, name: str):
        """The model slot `name` names, if this key may use it."""
        return resolve_model(self.request, name, self.kinds)

    async def parse(self, fields: F) -> ParsedRequest:
        raise NotImplementedError

    def emitter(self, sse: SSEWriter, gen: Generation) -> Emitter:
        return self.Emitter(sse, gen)

    def render(self, gen: Generation, out: Outcome) -> dict:
        raise NotImplementedError

    # -- the steps every family shares -----------------------------------------------------------

    async def respond(self, parsed: ParsedRequest) -> web.StreamResponse:
        """The answer; on the editor wire (/infill, or a FIM request that names its file) it
        first ends the older request for the same file (fim_support.Superseding: a keystroke
        typed over is not decoded). Elsewhere (`suffix` on /v1/completions) requests that
        look alike are unrelated: evaluation harnesses send them in parallel."""
        fim = parsed.fim
        if fim is None or not (self.supersedes or fim.get("filename")):
            return await self.answer(parsed)
        identity = file_identity(fim["prefix"], fim["suffix"], fim.get("filename"))
        release = superseding(self.request.app).claim(self.request, self.slot.name, identity)
        try:
            return await self.answer(parsed)
        finally:
            release()

    async def answer(self, parsed: ParsedRequest) -> web.StreamResponse:
        """Generate: one JSON body from `render`, or a stream of the family's events."""
        gen = generation(self.request, self.slot, await build_request(self.request, self.slot, parsed))
        headers = {**self.headers, **omitted_header(parsed)}
        if parsed.stream:
            return await run_stream(self.request, gen, self.emitter, headers, self.writer)
        async with gen:
            out = await gen.result()
        return web.json_response(self.render(gen, out), headers=headers)


A = TypeVar("A", bound=ApiFamily)


def omitted_header(parsed: ParsedRequest) -> dict[str, str]:
    """Names what a text-only model was sent a placeholder for (images in tool results), and
    what it was sent as text instead (audio transcribed by the entry's chat.audio_model)."""
    headers = {"x-mlxgw-omitted-content": ",".join(sorted(set(parsed.omitted)))} if parsed.omitted else {}
    if parsed.transcribed:
        headers["x-mlxgw-transcribed-content"] = ",".join(sorted(set(parsed.transcribed)))
    return headers


async def open_family(request: web.Request, family: type[A]) -> tuple[A, ParsedRequest]:
    """The request read and decoded once, its model resolved and its fields parsed."""
    body = await read_object(request)
    request["session_id"] = session_id(request.headers, body)
    fields = decode_fields(body, family.Fields)
    api = family(request, body)
    name = api.model_name(fields)
    if name is None:
        raise invalid("missing required parameter: 'model'", "model")
    api.slot = api.resolve(name)
    return api, await api.parse(fields)


async def handle(request: web.Request, family: type[ApiFamily]) -> web.StreamResponse:
    """Every generating route: the request opened (open_family), then answered."""
    api, parsed = await open_family(request, family)
    return await api.respond(parsed)


async def open_fields(
    request: web.Request, kind: type[M], kinds: tuple[ModelKind, ...] = CHAT_KINDS
) -> tuple[M, object]:
    """The preamble of a route that generates no text (embeddings, rerank, tokenize): the body
    decoded once into its struct, `model` included, and the model slot it names."""
    fields = decode_fields(await read_object(request), kind)
    if fields.model is None:
        raise invalid("missing required parameter: 'model'", "model")
    return fields, resolve_model(request, fields.model, kinds)


def generation(request: web.Request, slot, req: p.WorkerRequest) -> Generation:
    """The request's generation, also recorded on the request for limits, metrics and logs."""
    key = request.get("key")
    if isinstance(req, p.GenerateRequest):  # embeddings are charged their input only
        reserve_tokens(request, slot, req.max_tokens * req.n if req.max_tokens is not None else None, req.n)
    owner = key.name if key else None
    session = request.get("session_id")
    gen = Generation(request.app[MANAGER], slot, req, request.app[SETTINGS].keepalive_s, owner=owner, session=session)
    request["generation"] = gen
    span = request.get(SPAN)
    if span is not None:  # traced: the worker returns its times (pipeline/tracing.py)
        trace_generation(request, span, gen)
    superseded = request.get("superseded")
    if superseded is not None:  # superseded before its generation was made
        gen.end_with(superseded)
    return gen
