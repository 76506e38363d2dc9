"""Anthropic Messages: POST /v1/messages (streaming and not) and /v1/messages/count_tokens.

Claude Code posts to /v1/messages?beta=true with many betas and fields this server does
not use: unknown fields are accepted and ignored, never a 400."""

from __future__ import annotations

import json
import secrets

from aiohttp import web
from mlxgw.shared import protocol as p
from mlxgw.shared.errors import ServiceError, invalid

from ..auth import resolve_model
from ..generation import Generation
from ..sse import SSEWriter
from ..state import MANAGER, SETTINGS
from . import openai_common as oc
from . import validate as v
from .anthropic_errors import anthropic_error_body
from .body import read_json
from .images import ImageLimits, collect_images, from_base64, from_url, image_limits, join_content

routes = web.RouteTableDef()

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "tool_calls": "tool_use"}


def _text_of(content, where: str) -> str:
    """Text of a string or of text blocks (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of content blocks")
    parts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise invalid(f"{where}[{i}].text: Input should be a valid string")
            parts.append(block["text"])
        elif kind == "image":
            raise invalid(f"{where}[{i}]: images are accepted in message content only")
        elif kind in ("document", "search_result"):
            raise invalid(f"{where}[{i}]: content blocks of type {kind!r} are not supported")
        elif kind is None:
            raise invalid(f"{where}[{i}]: each content block needs a 'type'")
        # Other block types (thinking, redacted_thinking, ...) carry nothing the template needs.
    return "\n".join(parts)


def _image(block: dict, where: str, images: ImageLimits | None) -> dict:
    if images is None:
        raise invalid(f"{where}: this model does not accept images; use a vision model")
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return from_base64(source.get("media_type"), source.get("data"), where, images)
    if kind == "url":
        return from_url(source.get("url"), where, images)
    raise invalid(f"{where}.source: an image source must be of type 'base64' or 'url'")


def _convert_message(m: dict, i: int, images: ImageLimits | None) -> list[dict]:
    where = f"messages.{i}"
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise invalid(f"{where}.role: Input should be 'user' or 'assistant'")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content: Input should be a valid string or list of content blocks")
    out: list[dict] = []
    pieces: list = []  # text, and image parts for vision models
    calls: list[dict] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str):
                raise invalid(f"{where}.content.{j}.name: Field required")
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block["name"], "arguments": block.get("input") or {}},
                }
            )
        elif kind == "tool_result" and role == "user":
            result = _text_of(block.get("content") or "", f"{where}.content.{j}.content")
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
        elif kind == "image":
            pieces.append(_image(block, f"{where}.content.{j}", images))
        else:
            pieces.append(_text_of([block], f"{where}.content"))
    if pieces or calls or not out:
        msg = {"role": role, "content": join_content([x for x in pieces if x])}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def parse_request(body: dict, images: ImageLimits | None) -> dict:
    """Validate an Anthropic request; return the fields of the internal request."""
    raw_messages = v.required(body, "messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise invalid("messages: at least one message is required", "messages")
    messages: list[dict] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    for i, m in enumerate(raw_messages):
        if not isinstance(m, dict):
            raise invalid(f"messages.{i}: Input should be a valid dictionary")
        messages.extend(_convert_message(m, i, images))
    tools = None
    if body.get("tools") is not None:
        if not isinstance(body["tools"], list):
            raise invalid("tools: Input should be a valid list", "tools")
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.get("name"),
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema") or {},
                },
            }
            for t in body["tools"]
            if isinstance(t, dict) and t.get("name")
        ]
    choice = body.get("tool_choice")
    forced = None
    if isinstance(choice, dict) and choice.get("type") == "none":
        tools = None
    elif isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        if not tools:
            raise invalid("tool_choice requires tools", "tool_choice")
        forced = {"type": "tool_call", "tools": tools, "name": choice.get("name") if choice["type"] == "tool" else None}
    constraint = None
    config = body.get("output_config")
    fmt = config.get("format") if isinstance(config, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("output_config.format.schema must be a JSON schema object")
        constraint = {"type": "json_schema", "schema": fmt["schema"]}
    if forced is not None:
        if constraint is not None:
            raise invalid("output_config.format and a forced tool_choice cannot be combined")
        constraint = forced
    thinking = body.get("thinking")
    template_kwargs = None
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled", "adaptive"):
        # Qwen3-style templates switch reasoning with enable_thinking; others ignore it.
        template_kwargs = {"enable_thinking": thinking["type"] != "disabled"}
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) and thinking.get("type") == "enabled" else None
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise invalid("thinking.budget_tokens: Input should be a non-negative integer")
    return {
        "messages": messages,
        "tools": tools or None,
        "constraint": constraint,
        "chat_template_kwargs": template_kwargs,
        "reasoning_budget": budget,
    }


def _sampling(body: dict, slot) -> p.SamplingParams:
    d = slot.entry.defaults
    temperature = v.number(body, "temperature", 0, 1)
    top_p = v.number(body, "top_p", 0, 1)
    top_k = v.integer(body, "top_k", 0)
    return p.SamplingParams(
        temperature=oc.first_set(temperature, d.temperature, 1.0),
        top_p=oc.first_set(top_p, d.top_p, 1.0),
        top_k=oc.first_set(top_k, d.top_k, 0),
        min_p=oc.first_set(d.min_p, 0.0),
        repetition_penalty=d.repetition_penalty,
    )


async def _build(request: web.Request, body: dict, slot) -> p.GenerateRequest:
    max_tokens = v.integer(body, "max_tokens", lo=1)
    if max_tokens is None:
        raise invalid("max_tokens: Field required", "max_tokens")
    cap = request.app[SETTINGS].max_tokens_cap
    fields = await _with_images(request, body, slot)
    return p.GenerateRequest(
        rid=request["rid"],
        sampling=_sampling(body, slot),
        stop=v.string_list(body, "stop_sequences"),
        max_tokens=min(max_tokens, cap) if cap else max_tokens,
        max_tokens_policy=slot.entry.max_tokens_policy,
        timeout_s=request.app[SETTINGS].request_timeout_s,
        stream_interval=slot.entry.stream_interval,
        **fields,
    )


def _usage(u: p.Usage) -> dict:
    return {
        "input_tokens": u.prompt_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _stop(reason: str, stop: str | None) -> tuple[str, str | None]:
    if reason == "stop" and stop:
        return "stop_sequence", stop
    return STOP_REASONS.get(reason, "end_turn"), None


async def _with_images(request: web.Request, body: dict, slot) -> dict:
    """The request's fields, with images moved out of the messages (URLs fetched)."""
    limits = image_limits(request, slot)
    fields = parse_request(body, limits)
    fields["messages"], fields["images"] = await collect_images(fields["messages"], limits)
    return fields


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    body = v.require_object(await read_json(request))
    model = v.string(body, "model", required_=True)
    slot = resolve_model(request, model)
    req = await _build(request, body, slot)
    gen = oc.generation(request, slot, req)
    if v.boolean(body, "stream"):
        return await _stream(request, gen)
    async with gen:
        out = await gen.result()
    stop_reason, stop_sequence = _stop(out.finish_reason, out.stop)
    content = []
    if out.reasoning:
        content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.text or not out.tool_calls:
        content.append({"type": "text", "text": out.text})
    content += [_tool_use(c) for c in out.tool_calls]
    return web.json_response(
        {
            "id": f"msg_{secrets.token_hex(12)}",
            "type": "message",
            "role": "assistant",
            "model": slot.name,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(out.usage),
        }
    )


def _tool_use(call: dict) -> dict:
    try:
        arguments = json.loads(call["arguments"])
    except ValueError:
        arguments = {"_raw": call["arguments"]}
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": call["name"],
        "input": arguments if isinstance(arguments, dict) else {"value": arguments},
    }


class _Blocks:
    """Anthropic content blocks on a stream: one open at a time, each started, filled with
    deltas of its own type, and stopped before the next starts."""

    def __init__(self, sse: SSEWriter):
        self.sse = sse
        self.index = -1
        self.open_type: str | None = None

    async def _start(self, block: dict) -> None:
        await self.close()
        self.index += 1
        self.open_type = block["type"]
        await self.sse.data(
            {"type": "content_block_start", "index": self.index, "content_block": block}, "content_block_start"
        )

    async def _delta(self, delta: dict) -> None:
        await self.sse.data({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    async def thinking(self, text: str) -> None:
        if self.open_type != "thinking":
            await self._start({"type": "thinking", "thinking": "", "signature": ""})
        await self._delta({"type": "thinking_delta", "thinking": text})

    async def text(self, text: str) -> None:
        if self.open_type != "text":
            await self._start({"type": "text", "text": ""})
        if text:
            await self._delta({"type": "text_delta", "text": text})

    async def tool_use(self, call: dict) -> None:
        block = _tool_use(call)
        await self._start({**block, "input": {}})
        await self._delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])})

    async def close(self) -> None:
        if self.open_type is not None:
            await self.sse.data({"type": "content_block_stop", "index": self.index}, "content_block_stop")
            self.open_type = None


async def _stream(request: web.Request, gen: Generation) -> web.StreamResponse:
    """Anthropic's event order: message_start, then per content block content_block_start,
    deltas and content_block_stop (thinking, text, tool_use), then message_delta and
    message_stop; pings keep the connection alive; an error event ends a failed stream."""
    sse = SSEWriter(request, request.app[SETTINGS].write_timeout_s)
    gen.on_wait = sse.comment  # SSE comments: clients ignore them even before message_start
    blocks = _Blocks(sse)
    try:
        async with gen:
            start = {
                "id": f"msg_{secrets.token_hex(12)}",
                "type": "message",
                "role": "assistant",
                "model": gen.slot.name,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": _usage(gen.usage),
            }
            await sse.data({"type": "message_start", "message": start}, "message_start")
            await sse.data({"type": "ping"}, "ping")
            async for ev in gen.content(on_idle=lambda: sse.data({"type": "ping"}, "ping")):
                kind = ev["e"]
                if ev.get("reasoning"):
                    await blocks.thinking(ev["reasoning"])
                if ev.get("text"):
                    await blocks.text(ev["text"])
                for call in ev.get("tool_calls") or []:
                    await blocks.tool_use(call)
                if kind == p.EV_FINISH:
                    if blocks.index < 0:
                        await blocks.text("")  # every message has at least one content block
                    await blocks.close()
                    stop_reason, stop_sequence = _stop(ev.get("reason", "stop"), ev.get("stop"))
                    await sse.data(
                        {
                            "type": "message_delta",
                            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            "usage": _usage(gen.usage),
                        },
                        "message_delta",
                    )
                    await sse.data({"type": "message_stop"}, "message_stop")
    except ServiceError as err:
        if not sse.opened:
            raise
        await sse.error(anthropic_error_body(err), "error")
    await sse.close()
    return sse.response


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    body = v.require_object(await read_json(request))
    model = v.string(body, "model", required_=True)
    manager = request.app[MANAGER]
    slot = resolve_model(request, model)
    fields = await _with_images(request, body, slot)
    fields.pop("constraint")  # counting tokens needs the prompt, not the grammar
    fields.pop("reasoning_budget")
    conn = await manager.acquire(slot)
    result = await manager.broker.call(conn, "tokenize", fields)
    return web.Response(text=json.dumps({"input_tokens": result["tokens"]}), content_type="application/json")
