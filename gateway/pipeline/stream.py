"""The one streaming driver: a generation as server-sent events in some API's shape.

`run_stream` owns what every streaming API shares (keep-alives while the model loads and
while the prompt is prefilled, cancelling the request when the client goes, the error event
that ends a failed stream, the end written exactly once); an `Emitter` writes only its API's
events. Headers are committed by the first event written: a request refused before that
(bad content found by the worker, a full queue) is still a plain HTTP error with its status."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from ...shared.errors import ErrorCode, ServiceError
from ...shared.events import Finish
from ..models.generation import Generation
from ..web.sse import SSEWriter
from ..web.state import SETTINGS


class Emitter:
    """One API's streamed events. run_stream calls `opened` once the worker accepted the
    request, then `reasoning`, `text` and `tool_call` for each piece of output in order, then
    `finished` once; `idle` on keep-alive ticks after opening. With n > 1 choices, `index`
    is the choice the call belongs to. Per-token logprob entries (when the request asked)
    come with the text they belong to (`text_with_logprobs`), or alone (`logprobs`) for
    tokens that became reasoning or tool calls."""

    error_event: str | None = None  # the SSE event name of an error ("error"), if the API names it

    def __init__(self, sse: SSEWriter, gen: Generation):
        self.sse, self.gen = sse, gen
        self.choice = 0  # the choice (n > 1) the next call belongs to

    async def opened(self) -> None:
        pass

    async def reasoning(self, text: str) -> None:
        pass

    async def text(self, text: str) -> None:
        pass

    async def tool_call(self, call: dict) -> None:
        pass

    async def text_with_logprobs(self, text: str, entries: list[dict]) -> None:
        await self.text(text)
        await self.logprobs(entries)

    async def logprobs(self, entries: list[dict]) -> None:
        pass

    async def finished(self, event: Finish) -> None:
        pass

    async def idle(self) -> None:
        await self.sse.comment()

    def error_body(self, err: ServiceError) -> dict:
        raise NotImplementedError


EmitterFactory = Callable[[SSEWriter, Generation], Emitter]


async def run_stream(
    request: web.Request,
    gen: Generation,
    make: EmitterFactory,
    headers: dict[str, str] | None = None,
    writer: type[SSEWriter] = SSEWriter,
) -> web.StreamResponse:
    """writer: the wire format (server-sent events; Ollama's NDJSON is a subclass)."""
    sse = writer(request, request.app[SETTINGS].write_timeout_s)
    sse.response.headers.update(headers or {})
    gen.on_wait = sse.comment  # SSE comments: every client ignores them, even before the first event
    out = make(sse, gen)
    try:
        async with gen:
            await out.opened()
            # Events already waiting are written together, before the next wait for the worker.
            sse.hold()
            gen.before_wait = sse.release
            finished = False
            async for ev in gen.content(on_idle=out.idle):
                out.choice = ev.index or 0
                entries = ev.logprobs
                if ev.reasoning:
                    await out.reasoning(ev.reasoning)
                if ev.text and entries:
                    await out.text_with_logprobs(ev.text, entries)
                    entries = None
                elif ev.text:
                    await out.text(ev.text)
                for call in ev.tool_calls or ():
                    await out.tool_call(call)
                if entries:
                    await out.logprobs(entries)
                if type(ev) is Finish:
                    finished = True
                    await out.finished(ev)
            if not finished:
                raise ServiceError(ErrorCode.INTERNAL, "the generation ended without a finish event")
    except ServiceError as err:
        if not sse.opened:
            raise
        await sse.error(out.error_body(err), out.error_event)
    await sse.close()
    return sse.response
