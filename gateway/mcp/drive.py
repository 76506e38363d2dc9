"""The tool loop driven for one request: one JSON body, or one stream across its turns.

Mirrors translate.respond and stream.run_stream (whose rules hold here too: keep-alives, the
error event that ends a failed stream, the end written once), with a generation per turn."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from mlxgw.shared import protocol as p
from mlxgw.shared.errors import ErrorCode, ServiceError

from ..api import translate as t
from ..api.stream import Emitter, EmitterFactory
from ..generation import Generation, Outcome
from ..sse import SSEWriter
from ..state import SETTINGS
from .loop import McpCall, ToolLoop, new_call_id


@dataclass
class McpHooks:
    """What an API adds to the loop: how its stream shows an MCP call and its result, and
    how its body lists the calls."""

    call: Callable[[Emitter, dict, str], object]  # (emitter, call, server_label) -> awaitable
    result: Callable[[Emitter, McpCall], object]  # (emitter, finished call) -> awaitable
    decorate: Callable[[dict, list[McpCall]], None]  # the non-streamed body, the calls run
    also_extend: list[list[dict]] = field(default_factory=list)  # other histories to extend (Responses' store)


async def _turn_request(request: web.Request, slot, parsed: t.ParsedRequest, loop: ToolLoop, client_tools):
    loop.prepare(parsed, client_tools)
    return t.generation(request, slot, await t.build_request(request, slot, parsed))


async def respond(
    request: web.Request,
    slot,
    parsed: t.ParsedRequest,
    loop: ToolLoop,
    hooks: McpHooks,
    emitter: EmitterFactory,
    render: Callable[[Generation, Outcome], dict],
    headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    headers = {**(headers or {}), **t.omitted_header(parsed)}
    client_tools = parsed.tools
    if parsed.stream:
        return await _stream(request, slot, parsed, loop, hooks, emitter, headers, client_tools)
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


async def _stream(request, slot, parsed, loop: ToolLoop, hooks: McpHooks, make: EmitterFactory, headers, client_tools):
    sse = SSEWriter(request, request.app[SETTINGS].write_timeout_s)
    sse.response.headers.update(headers)
    out: Emitter | None = None
    shown = 0  # tool calls already shown: Chat's indices continue across turns
    try:
        while True:
            offering = loop.offering()
            gen = await _turn_request(request, slot, parsed, loop, client_tools)
            gen.on_wait = sse.comment
            mine: list[dict] = []
            client_calls = 0
            texts: list[str] = []
            finish: dict | None = None
            async with gen:
                if out is None:
                    out = make(sse, gen)
                    await out.opened()
                out.gen = gen
                if hasattr(out, "builder"):  # the Responses emitter's response object reads it too
                    out.builder.gen = gen
                async for ev in gen.content(on_idle=out.idle):
                    if ev.get("reasoning"):
                        await out.reasoning(ev["reasoning"])
                    if ev.get("text"):
                        texts.append(ev["text"])
                        await out.text(ev["text"])
                    for call in ev.get("tool_calls") or []:
                        call = {**call, "index": call.get("index", 0) + shown, "id": call.get("id") or new_call_id()}
                        if offering and loop.is_mcp(call):
                            mine.append(call)
                            await hooks.call(out, call, loop.tools[call["name"]].label)
                        else:
                            client_calls += 1
                            await out.tool_call(call)
                    if ev["e"] == p.EV_FINISH:
                        finish = ev
            if finish is None:
                raise ServiceError(ErrorCode.INTERNAL, "the generation ended without a finish event")
            total = loop.add_usage(gen.usage)
            if mine:
                shown += len(mine) + client_calls
                results = await _run_with_keepalive(loop, mine, sse, request.app[SETTINGS].keepalive_s)
                for r in results:
                    await hooks.result(out, r)
                if not client_calls:
                    loop.extend(parsed.messages, "".join(texts), results, *hooks.also_extend)
                    continue
            gen.usage = total
            await out.finished(finish)
            break
    except ServiceError as err:
        if not sse.opened or out is None:
            raise
        await sse.error(out.error_body(err), out.error_event)
    await sse.close()
    return sse.response
