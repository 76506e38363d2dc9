"""The tool loop driven for one request: one JSON body, or one stream across its turns.

Mirrors serving.ApiFamily.answer and stream.run_stream (whose rules hold here too: keep-alives,
the error event that ends a failed stream, the end written once), with a generation per turn.
`McpFamily` is the ApiFamily of an API whose requests may name MCP servers (Chat, Responses)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from ...shared.errors import ErrorCode, ServiceError
from ...shared.events import Delta, Finish
from ..models.generation import Generation, Outcome
from ..pipeline.serving import ApiFamily, generation, omitted_header
from ..pipeline.stream import Emitter, EmitterFactory
from ..pipeline.translate import ParsedRequest, build_request
from ..web.sse import SSEWriter
from ..web.state import SETTINGS
from .loop import McpCall, ToolLoop, new_call_id


@dataclass
class McpHooks:
    """What an API adds to the loop: how its stream shows an MCP call and its result, and
    how its body lists the calls."""

    call: Callable[[Emitter, dict, str], object]  # (emitter, call, server_label) -> awaitable
    result: Callable[[Emitter, McpCall], object]  # (emitter, finished call) -> awaitable
    decorate: Callable[[dict, list[McpCall]], None]  # the non-streamed body, the calls run
    also_extend: list[list[dict]] = field(default_factory=list)  # other histories to extend (Responses' store)


def split_tools(raw) -> tuple[list | None, list[dict]]:
    """The request's tools without the MCP entries, and the MCP entries."""
    if not isinstance(raw, list):
        return raw, []
    mcp = [x for x in raw if isinstance(x, dict) and x.get("type") == "mcp"]
    rest = [x for x in raw if not (isinstance(x, dict) and x.get("type") == "mcp")]
    return (rest if rest or not mcp else None), mcp


class McpFamily(ApiFamily):
    """An API whose requests may name MCP servers: parse takes their tools out of the
    request's (`take_mcp_tools`) and, when there are any, the tool loop answers."""

    mcp_loop: ToolLoop | None = None

    def take_mcp_tools(self, fields) -> None:
        """The fields keep the client's own tools; the MCP ones (and the model's default
        servers') go to this request's loop, unless tool_choice is "none"."""
        rest, specs = split_tools(fields.tools)
        if not specs and not self.slot.entry.mcp_servers:
            return
        fields.tools = rest
        if fields.tool_choice != "none":
            loop = ToolLoop(self.request, self.slot, specs, rest)
            self.mcp_loop = loop if loop.active else None

    def mcp_hooks(self) -> McpHooks:
        raise NotImplementedError

    async def answer(self, parsed: ParsedRequest) -> web.StreamResponse:
        if self.mcp_loop is None:
            return await super().answer(parsed)
        hooks = self.mcp_hooks()
        return await respond(
            self.request, self.slot, parsed, self.mcp_loop, hooks, self.emitter, self.render, self.headers
        )


async def _turn_request(request: web.Request, slot, parsed: ParsedRequest, loop: ToolLoop, client_tools):
    loop.prepare(parsed, client_tools)
    return generation(request, slot, await build_request(request, slot, parsed))


async def respond(
    request: web.Request,
    slot,
    parsed: ParsedRequest,
    loop: ToolLoop,
    hooks: McpHooks,
    emitter: EmitterFactory,
    render: Callable[[Generation, Outcome], dict],
    headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    headers = {**(headers or {}), **omitted_header(parsed)}
    client_tools = parsed.tools
    if parsed.stream:
        return await _McpStream(request, slot, parsed, loop, hooks, emitter, client_tools).respond(headers)
    while True:
        offering = loop.offering()
        gen = await _turn_request(request, slot, parsed, loop, client_tools)
        async with gen:
            out = await gen.result()
        total = loop.add_usage(out.usage)
        mine = [c for c in out.tool_calls if loop.is_mcp(c)] if offering else []
        if mine:
            results = await loop.run(mine)
            if len(mine) == len(out.tool_calls):
                loop.extend(parsed.messages, out.text, results, *hooks.also_extend)
                continue
            # The client's own calls go back to it; the MCP calls beside them were run and are
            # listed by hooks.decorate, not handed to the client to run.
            out.tool_calls = [c for c in out.tool_calls if not loop.is_mcp(c)]
        out.usage = gen.usage = total
        body = render(gen, out)
        hooks.decorate(body, loop.calls)
        return web.json_response(body, headers=headers)


async def _run_with_keepalive(loop: ToolLoop, calls: list[dict], sse: SSEWriter, every_s: float) -> list[McpCall]:
    """The calls run while the stream gets a comment every keep-alive interval."""
    task = asyncio.ensure_future(loop.run(calls))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            await sse.comment()
    finally:
        task.cancel()


@dataclass
class _Turn:
    """What one streamed generation produced, as far as the loop cares."""

    mcp_calls: list[dict] = field(default_factory=list)
    client_calls: int = 0
    texts: list[str] = field(default_factory=list)
    finish: Finish | None = None


class _McpStream:
    """One stream across the loop's turns: one emitter, opened once and finished once."""

    def __init__(self, request: web.Request, slot, parsed, loop: ToolLoop, hooks: McpHooks, make, client_tools):
        self.request, self.slot, self.parsed, self.loop, self.hooks = request, slot, parsed, loop, hooks
        self.make, self.client_tools = make, client_tools
        self.sse = SSEWriter(request, request.app[SETTINGS].write_timeout_s)
        self.out: Emitter | None = None
        self.shown = 0  # tool calls already shown: Chat's indices continue across turns

    async def respond(self, headers: dict[str, str]) -> web.StreamResponse:
        self.sse.response.headers.update(headers)
        try:
            while not await self._turn():
                pass
        except ServiceError as err:
            if not self.sse.opened or self.out is None:
                raise
            await self.sse.error(self.out.error_body(err), self.out.error_event)
        await self.sse.close()
        return self.sse.response

    async def _turn(self) -> bool:
        """One generation, and its MCP calls run; True once the client's turn is over."""
        offering = self.loop.offering()
        gen = await _turn_request(self.request, self.slot, self.parsed, self.loop, self.client_tools)
        gen.on_wait = self.sse.comment
        turn = _Turn()
        async with gen:
            out = self._emitter(gen)
            if self.out is None:
                self.out = out
                await out.opened()
            async for ev in gen.content(on_idle=out.idle):
                await self._show(ev, turn, offering)
        if turn.finish is None:
            raise ServiceError(ErrorCode.INTERNAL, "the generation ended without a finish event")
        total = self.loop.add_usage(gen.usage)
        if turn.mcp_calls:
            self.shown += len(turn.mcp_calls) + turn.client_calls
            every_s = self.request.app[SETTINGS].keepalive_s
            results = await _run_with_keepalive(self.loop, turn.mcp_calls, self.sse, every_s)
            for r in results:
                await self.hooks.result(out, r)
            if not turn.client_calls:
                self.loop.extend(self.parsed.messages, "".join(turn.texts), results, *self.hooks.also_extend)
                return False
        gen.usage = total
        await out.finished(turn.finish)
        return True

    def _emitter(self, gen: Generation) -> Emitter:
        """The stream's one emitter, pointed at this turn's generation."""
        out = self.out or self.make(self.sse, gen)
        out.gen = gen
        if hasattr(out, "builder"):  # the Responses emitter's response object reads it too
            out.builder.gen = gen
        return out

    async def _show(self, ev: Delta | Finish, turn: _Turn, offering: bool) -> None:
        out = self.out
        if ev.reasoning:
            await out.reasoning(ev.reasoning)
        if ev.text:
            turn.texts.append(ev.text)
            await out.text(ev.text)
        for call in ev.tool_calls or ():
            call = {**call, "index": call.get("index", 0) + self.shown, "id": call.get("id") or new_call_id()}
            if offering and self.loop.is_mcp(call):
                turn.mcp_calls.append(call)
                await self.hooks.call(out, call, self.loop.tools[call["name"]].label)
            else:
                turn.client_calls += 1
                await out.tool_call(call)
        if type(ev) is Finish:
            turn.finish = ev
