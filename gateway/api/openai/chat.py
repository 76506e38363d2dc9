"""OpenAI Chat Completions: POST /v1/chat/completions, one ApiFamily (`OpenAIChat`)."""

from __future__ import annotations

from aiohttp import web

from ....shared.errors import invalid
from ...mcp.drive import McpFamily, McpHooks
from ...models.generation import Generation, Outcome
from ...pipeline import audio_parts, video
from ...pipeline.cache_hints import openai_retention
from ...pipeline.fields import ChatFields
from ...pipeline.images import ImageLimits, from_openai_part, join_content
from ...pipeline.serving import handle
from ...pipeline.tools import openai_constraint, template_arguments
from ...pipeline.translate import ParsedRequest, image_limits
from . import common as oc
from .mcp_calls import chat_hooks

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
        elif part["type"] in ("video_url", "input_video"):
            pieces.append(video.from_openai_part(part, f"{where}.content[{i}]", images))
        elif part["type"] in ("input_audio", "audio_url"):
            pieces.append(audio_parts.from_openai_part(part, f"{where}.content[{i}]"))
        else:
            raise invalid(f"{where}.content[{i}] has unsupported type {part['type']!r}", where)
    return join_content(pieces)


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


def _response_format(fmt: dict | None) -> dict | None:
    if fmt and fmt.get("type") == "json_schema":  # Chat nests the schema one level deeper
        spec = fmt.get("json_schema")
        return {"type": "json_schema", "schema": spec.get("schema") if isinstance(spec, dict) else None}
    return fmt


def choices_count(n: int | None, best_of: int | None) -> int:
    """n (1-16, ranges checked by fields.ChatFields): Chat Completions has no best_of, which
    is taken only where it ranks nothing (1 or n). Completions ranks best_of candidates
    (openai_completions._choices)."""
    n = n or 1
    if best_of not in (None, 1, n):
        raise invalid(
            f"best_of > n is not supported (choices are not ranked); send best_of={n} or leave it out", "best_of"
        )
    return n


def logprobs_wanted(wanted: bool | None, top: int | None) -> int | None:
    """Chat's logprobs (bool) and top_logprobs (0-20): alternatives per token, or None."""
    if top and not wanted:  # top_logprobs: 0 alone is harmless (some clients always send it)
        raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
    return (top or 0) if wanted else None


def parse(f: ChatFields, images: ImageLimits | None) -> tuple[ParsedRequest, bool]:
    """The request, and whether a stream ends with a usage chunk. One pass over the decoded
    struct (fields.ChatFields: every field's type and range): each field that needs more
    than that is checked once."""
    if f.messages is None:
        raise invalid("missing required parameter: 'messages'", "messages")
    tools = None if f.tool_choice == "none" else f.tools
    constraint = openai_constraint(
        _response_format(f.response_format),
        f.tool_choice,
        tools,
        "response_format",
        "response_format.json_schema.schema",
        "response_format",
    )
    parsed = ParsedRequest(
        messages=parse_messages(f.messages, images),
        tools=tools,
        constraint=constraint,
        chat_template_kwargs=f.chat_template_kwargs,
        n=choices_count(f.n, f.best_of),
        logprobs=logprobs_wanted(f.logprobs, f.top_logprobs),
        cache_retention_s=openai_retention(f.prompt_cache_retention),
        **f.request_fields(),
    )
    return parsed, oc.include_usage(f.stream_options, f.stream)


class OpenAIChat(McpFamily):
    Fields = ChatFields
    include_usage = False  # a stream ends with a usage chunk (stream_options.include_usage)

    async def parse(self, fields: ChatFields) -> ParsedRequest:
        self.take_mcp_tools(fields)  # MCP tools run by the gateway (gateway/mcp/)
        parsed, self.include_usage = parse(fields, image_limits(self.request, self.slot))
        return parsed

    def emitter(self, sse, gen: Generation) -> ChatChunks:
        return ChatChunks(sse, gen, self.include_usage)

    def render(self, gen: Generation, out: Outcome) -> dict:
        wants_logprobs = gen.req.logprobs is not None
        return oc.completion_body("chat.completion", "chatcmpl", gen, out, lambda o: _choice(o, wants_logprobs))

    def mcp_hooks(self) -> McpHooks:
        return chat_hooks()


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await handle(request, OpenAIChat)


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
