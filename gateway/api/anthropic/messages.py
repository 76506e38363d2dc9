"""Anthropic Messages: POST /v1/messages (streaming and not) and /v1/messages/count_tokens.

Claude Code posts to /v1/messages?beta=true with many betas and fields this server does
not use: unknown fields are accepted and ignored, never a 400. Sampling takes Anthropic's
temperature (0 to 1), top_p, top_k and stop_sequences, plus the mlxgw extensions every API
has (seed, min_p, repetition/presence/frequency penalties, logit_bias, priority)."""

from __future__ import annotations

import json
import secrets

from aiohttp import web

from ....shared.errors import ServiceError, invalid
from ....shared.events import Finish
from ...models.generation import Generation, Outcome
from ...pipeline.cache_hints import anthropic_retention, anthropic_usage
from ...pipeline.content import ContentPolicy
from ...pipeline.fields import AnthropicFields, ThinkingFields, decode_fields
from ...pipeline.serving import ApiFamily, handle, omitted_header
from ...pipeline.stream import Emitter
from ...pipeline.tools import (
    forced_tool,
    function_tool,
    is_deferred,
    json_schema_constraint,
    loaded_tool_names,
    one_constraint,
)
from ...pipeline.translate import ParsedRequest, build_request, image_limits
from ...web.anthropic_errors import anthropic_error_body
from ...web.state import MANAGER, SETTINGS
from .input import convert_messages, read_documents

routes = web.RouteTableDef()

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "tool_calls": "tool_use"}


def _tools(raw: object, messages: object) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise invalid("tools: Input should be a valid list", "tools")
    loaded = loaded_tool_names(messages)
    # Server tools (web_search, bash_20250124, ...) have no input_schema: nothing to call here.
    return [
        function_tool(x["name"], x.get("description"), x.get("input_schema"))
        for x in raw
        if isinstance(x, dict) and x.get("name") and x.get("type") in (None, "custom") and not is_deferred(x, loaded)
    ] or None


def _constraint(choice: object, config: object, tools: list[dict] | None) -> dict | None:
    kind = choice.get("type") if isinstance(choice, dict) else None
    forced = None
    if kind in ("any", "tool"):
        forced = forced_tool(tools, choice.get("name") if kind == "tool" else None)
    fmt = config.get("format") if isinstance(config, dict) else None
    output = None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        output = json_schema_constraint(fmt.get("schema"), "output_config.format.schema", "output_config")
    return one_constraint(output, forced, "output_config.format and a forced tool_choice")


def _thinking(thinking: object) -> tuple[dict | None, int | None]:
    """Template switch and reasoning budget from `thinking`."""
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        return None, None
    # Qwen3-style templates switch reasoning with enable_thinking; others ignore it.
    kwargs = {"enable_thinking": thinking["type"] != "disabled"}
    budget = decode_fields(thinking, ThinkingFields).budget_tokens if thinking["type"] == "enabled" else None
    return kwargs, budget


def _choice_disables_tools(choice: object) -> bool:
    return isinstance(choice, dict) and choice.get("type") == "none"


def parse(f: AnthropicFields, policy: ContentPolicy) -> ParsedRequest:
    """Validate an Anthropic request into the API-neutral parsed request: one pass over the
    decoded struct (fields.AnthropicFields), each field that needs more checked once."""
    if f.max_tokens is None:
        raise invalid("max_tokens: Field required", "max_tokens")
    tools = None if _choice_disables_tools(f.tool_choice) else _tools(f.tools, f.messages)
    template_kwargs, budget = _thinking(f.thinking)
    common = f.request_fields()
    if budget is not None:
        common["reasoning_budget"] = budget
    return ParsedRequest(
        messages=convert_messages(f.messages, f.system, policy),
        tools=tools,
        constraint=_constraint(f.tool_choice, f.output_config, tools),
        chat_template_kwargs=template_kwargs,
        omitted=policy.omitted,
        cache_retention_s=anthropic_retention(f.system, f.messages, f.tools),
        **common,
    )


def _usage(gen: Generation) -> dict:
    return anthropic_usage(gen.usage, getattr(gen.req, "cache_retention_s", None) is not None)


def _stop(reason: str, stop: str | None, time_limited: bool = False) -> tuple[str, str | None]:
    """The stop_reason of a finish. An answer cut by the server's answer time limit ends its
    turn: Claude Code reads `max_tokens` as its own budget running out and asks the model to
    go on (3 times, each a new time limit, then it fails with "exceeded the 128000 output
    token maximum"), which turned one slow answer into 20 minutes and an error on a slow
    host. The log and the ledger record the cut (`outcome=length time_limited=True`)."""
    if time_limited:
        return "end_turn", None
    if reason == "stop" and stop:
        return "stop_sequence", stop
    return STOP_REASONS.get(reason, "end_turn"), None


def _message(gen: Generation, content: list[dict], stop_reason: str | None, stop_sequence: str | None) -> dict:
    return {
        "id": f"msg_{secrets.token_hex(12)}",
        "type": "message",
        "role": "assistant",
        "model": gen.model_name,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(gen),
    }


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


class MessageEvents(Emitter):
    """Anthropic's event order: message_start, then per content block content_block_start,
    deltas of its own type and content_block_stop (one block open at a time: thinking, text,
    tool_use), then message_delta and message_stop; pings keep the connection alive."""

    error_event = "error"

    def __init__(self, sse, gen: Generation):
        super().__init__(sse, gen)
        self.index = -1
        self.open_type: str | None = None

    async def _event(self, kind: str, **fields) -> None:
        await self.sse.data({"type": kind, **fields}, kind)

    async def _start(self, block: dict) -> None:
        await self._close()
        self.index += 1
        self.open_type = block["type"]
        await self._event("content_block_start", index=self.index, content_block=block)

    async def _delta(self, delta: dict) -> None:
        await self._event("content_block_delta", index=self.index, delta=delta)

    async def _close(self) -> None:
        if self.open_type is not None:
            await self._event("content_block_stop", index=self.index)
            self.open_type = None

    async def opened(self) -> None:
        await self._event("message_start", message=_message(self.gen, [], None, None))
        await self.idle()

    async def idle(self) -> None:
        await self._event("ping")

    async def reasoning(self, text: str) -> None:
        if self.open_type != "thinking":
            await self._start({"type": "thinking", "thinking": "", "signature": ""})
        await self._delta({"type": "thinking_delta", "thinking": text})

    async def text(self, text: str) -> None:
        if self.open_type != "text":
            await self._start({"type": "text", "text": ""})
        if text:
            await self._delta({"type": "text_delta", "text": text})

    async def tool_call(self, call: dict) -> None:
        block = _tool_use(call)
        await self._start({**block, "input": {}})
        await self._delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])})

    async def finished(self, event: Finish) -> None:
        if self.index < 0:
            await self.text("")  # every message has at least one content block
        await self._close()
        stop_reason, stop_sequence = _stop(event.reason, event.stop, bool(event.time_limited))
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        await self._event("message_delta", delta=delta, usage=_usage(self.gen))
        await self._event("message_stop")

    def error_body(self, err: ServiceError) -> dict:
        return anthropic_error_body(err)


# -- the family -------------------------------------------------------------------------------


class AnthropicMessages(ApiFamily):
    Fields = AnthropicFields
    Emitter = MessageEvents

    async def parse(self, fields: AnthropicFields) -> ParsedRequest:
        policy = ContentPolicy(image_limits(self.request, self.slot))
        await read_documents(fields.messages, policy)
        return parse(fields, policy)

    def render(self, gen: Generation, out: Outcome) -> dict:
        content = []
        if out.reasoning:
            content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
        if out.text or not out.tool_calls:
            content.append({"type": "text", "text": out.text})
        content += [_tool_use(c) for c in out.tool_calls]
        return _message(gen, content, *_stop(out.finish_reason, out.stop, gen.time_limited))


class AnthropicTokenCount(AnthropicMessages):
    """/v1/messages/count_tokens: the same request, its prompt counted instead of generated."""

    async def parse(self, fields: AnthropicFields) -> ParsedRequest:
        if fields.max_tokens is None:
            fields.max_tokens = 1  # counting takes no max_tokens
        return await super().parse(fields)

    async def answer(self, parsed: ParsedRequest) -> web.Response:
        req = await build_request(self.request, self.slot, parsed)
        manager = self.request.app[MANAGER]
        conn = await manager.acquire(self.slot)
        # Counting needs the prompt, not the grammar or the sampling.
        args = {"messages": req.messages, "tools": req.tools, "chat_template_kwargs": req.chat_template_kwargs}
        if req.images:
            args["images"] = req.images
        # Tokenized on the worker's preparation thread, like a chat prompt: as long as a chat's.
        timeout = self.request.app[SETTINGS].prefill_timeout_s
        result = await manager.broker.call(conn, "tokenize", args, timeout=timeout)
        return web.json_response({"input_tokens": result["tokens"]}, headers=omitted_header(parsed))


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    return await handle(request, AnthropicMessages)


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.StreamResponse:
    return await handle(request, AnthropicTokenCount)
