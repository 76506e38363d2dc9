"""OpenAI Chat Completions: POST /v1/chat/completions."""

from __future__ import annotations

import json

from aiohttp import web

from mlxgw.gateway.api import openai_common as oc
from mlxgw.gateway.api.mcp_calls import chat_hooks
from mlxgw.gateway.mcp import drive as mcp_drive
from mlxgw.gateway.mcp import loop as mcp
from mlxgw.gateway.models.generation import Generation, Outcome
from mlxgw.gateway.pipeline import translate as t
from mlxgw.gateway.pipeline.fields import ChatFields, decode_fields
from mlxgw.gateway.pipeline.images import ImageLimits, from_openai_part, join_content
from mlxgw.shared.errors import invalid

routes = web.RouteTableDef()

ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def _content(content, where: str, images: ImageLimits | None) -> str | list[dict]:
    """Text, or text and image parts for a vision model (images: None for other models)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content parts", where)
    pieces: list = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"{where}.content[{i}] must be an object with a 'type'", where)
        if part["type"] in ("text", "input_text"):
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{i}].text must be a string", where)
            pieces.append(part["text"])
        elif part["type"] in ("image_url", "input_image"):
            pieces.append(from_openai_part(part, f"{where}.content[{i}]", images, where))
        else:
            raise invalid(f"{where}.content[{i}] has unsupported type {part['type']!r}", where)
    return join_content(pieces)


def template_arguments(args):
    """Tool-call arguments as chat templates expect them: an object where the JSON parses."""
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


def _tool_calls(raw, where: str) -> list[dict]:
    if not isinstance(raw, list):
        raise invalid(f"{where}.tool_calls must be a list", where)
    calls = []
    for call in raw:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"{where}.tool_calls entries need function.name", where)
        args = template_arguments(fn.get("arguments") or "{}")
        calls.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return calls


def parse_messages(raw, images: ImageLimits | None = None) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {role!r}", "messages")
        msg = {
            "role": "system" if role == "developer" else role,
            "content": _content(m.get("content"), where, images),
        }
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def tool_choice_constraint(choice, tools: list | None) -> dict | None:
    """tool_choice "required" or a named function: enforced by constrained decoding."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return t.forced_tool(tools, None)
    if isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        return t.forced_tool(tools, choice["function"]["name"])
    raise invalid("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', ...}", "tool_choice")


def output_format_constraint(fmt: dict | None, name: str, schema_where: str, param: str) -> dict | None:
    """An OpenAI output format (Chat's response_format, Responses' text.format)."""
    if not fmt or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] == "json_schema":
        return t.json_schema_constraint(fmt.get("schema"), schema_where, param)
    raise invalid(f"{name} type {fmt['type']!r} is not supported (text, json_object, json_schema)", param)


def _response_format(fmt: dict | None) -> dict | None:
    if fmt and fmt.get("type") == "json_schema":  # Chat nests the schema one level deeper
        spec = fmt.get("json_schema")
        return {"type": "json_schema", "schema": spec.get("schema") if isinstance(spec, dict) else None}
    return fmt


def parse(body: dict, images: ImageLimits | None) -> tuple[t.ParsedRequest, bool]:
    """The request, and whether a stream ends with a usage chunk. One pass: the body is
    decoded once (fields.ChatFields: every field's type and range), then each field that
    needs more than that is checked once, from the decoded struct."""
    f = decode_fields(body, ChatFields)
    if f.messages is None:
        raise invalid("missing required parameter: 'messages'", "messages")
    tools = None if f.tool_choice == "none" else f.tools
    constraint = t.one_constraint(
        output_format_constraint(
            _response_format(f.response_format),
            "response_format",
            "response_format.json_schema.schema",
            "response_format",
        ),
        tool_choice_constraint(f.tool_choice, tools),
        "response_format and a forced tool_choice",
    )
    parsed = t.ParsedRequest(
        messages=parse_messages(f.messages, images),
        tools=tools,
        constraint=constraint,
        chat_template_kwargs=f.chat_template_kwargs,
        n=oc.choices_count(f.n, f.best_of),
        logprobs=oc.chat_logprobs(f.logprobs, f.top_logprobs),
        **t.common_fields(f),
    )
    return parsed, oc.include_usage(f.stream_options, f.stream)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body, slot = await t.open_request(request)
    body, mcp_loop = mcp.from_request(request, slot, body)  # MCP tools run by the gateway (gateway/mcp/)
    parsed, usage = parse(body, t.image_limits(request, slot))
    if mcp_loop is not None:
        emitter = lambda sse, gen: ChatChunks(sse, gen, usage)  # noqa: E731
        return await mcp_drive.respond(request, slot, parsed, mcp_loop, chat_hooks(), emitter, _render)
    return await t.respond(request, slot, parsed, lambda sse, gen: ChatChunks(sse, gen, usage), _render)


def _render(gen: Generation, out: Outcome) -> dict:
    wants_logprobs = gen.req.logprobs is not None
    return oc.completion_body("chat.completion", "chatcmpl", gen, out, lambda o: _choice(o, wants_logprobs))


def chat_logprobs(entries: list[dict]) -> dict:
    return {"content": entries, "refusal": None}


def _choice(out: Outcome, wants_logprobs: bool) -> dict:
    message = {"role": "assistant", "content": out.text if out.text or not out.tool_calls else None, "refusal": None}
    if out.reasoning:
        message["reasoning_content"] = out.reasoning
    if out.tool_calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in out.tool_calls
        ]
    return {"message": message, "logprobs": chat_logprobs(out.logprobs) if wants_logprobs else None}


class ChatChunks(oc.OpenAIChunks):
    object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def delta(self, delta: dict, finish: str | None = None) -> dict:
        return self.chunk({"delta": delta, "finish_reason": finish})

    def finish_choice(self, reason: str | None) -> dict:
        return {"delta": {}, "finish_reason": reason}

    async def opened(self) -> None:
        for index in range(self.gen.req.n):
            self.choice = index
            await self.sse.data(self.delta({"role": "assistant", "content": ""}))

    async def reasoning(self, text: str) -> None:
        await self.sse.data(self.text_chunk("reasoning_content", text))

    async def text(self, text: str) -> None:
        await self.sse.data(self.text_chunk("content", text))

    async def text_with_logprobs(self, text: str, entries: list[dict]) -> None:
        await self.sse.data(
            self.chunk({"delta": {"content": text}, "logprobs": chat_logprobs(entries), "finish_reason": None})
        )

    async def logprobs(self, entries: list[dict]) -> None:
        await self.sse.data(self.chunk({"delta": {}, "logprobs": chat_logprobs(entries), "finish_reason": None}))

    async def tool_call(self, call: dict) -> None:
        # id and name first, then the arguments, as OpenAI streams them
        head = {"index": call["index"], "id": call["id"], "type": "function"}
        await self.sse.data(self.delta({"tool_calls": [{**head, "function": {"name": call["name"], "arguments": ""}}]}))
        args = {"index": call["index"], "function": {"arguments": call["arguments"]}}
        await self.sse.data(self.delta({"tool_calls": [args]}))
