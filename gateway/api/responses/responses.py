"""OpenAI Responses API: POST /v1/responses (Codex and the openai SDK's `responses`).

Input items become the one internal chat request; output comes back as reasoning,
message, function_call and custom_tool_call items (tools in every form: responses_tools.py).
`previous_response_id` continues a conversation from a
bounded in-memory store. Hosted tools this server cannot run (web_search, file_search,
computer_use_preview, ...) are left out of the prompt and named in the
`x-mlxgw-ignored-tools` response header instead of refused: refusing them is what makes
Codex unusable with other local servers. `function_call_output` takes text, images (a
placeholder for text-only models) and files; `input_file` takes PDFs and UTF-8 text."""

from __future__ import annotations

import json

from aiohttp import web

from ....shared.errors import invalid
from ...mcp.drive import McpFamily, McpHooks
from ...models.generation import Generation, Outcome
from ...pipeline import audio_parts, video
from ...pipeline.cache_hints import openai_retention
from ...pipeline.content import ContentPolicy, b64decode, data_url, read_pdfs, text_file, titled
from ...pipeline.fields import ResponsesFields, decode_fields
from ...pipeline.images import from_openai_part, join_content
from ...pipeline.serving import handle
from ...pipeline.tools import openai_constraint, template_arguments
from ...pipeline.translate import ParsedRequest, image_limits
from .output import STORE, ResponseEvents, render, responses_hooks
from .tools import ResponsesTools, custom_arguments, joined_name, parse_tools, split_name

routes = web.RouteTableDef()

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _file_bytes(part: dict, where: str) -> tuple[bytes, bool]:
    """The bytes of an input_file part, and whether they are a PDF."""
    data = part.get("file_data")
    if not isinstance(data, str):
        how = "file_id" if part.get("file_id") else "file_url" if part.get("file_url") else None
        if how:
            raise invalid(f"{where}: files by {how} are not fetched by this server; send file_data", "input")
        raise invalid(f"{where}: an input_file needs file_data", "input")
    parsed = data_url(data)
    media_type, b64 = parsed if parsed else ("", data)
    raw = b64decode(b64, where, "input")
    is_pdf = media_type == "application/pdf" or str(part.get("filename", "")).lower().endswith(".pdf")
    return raw, is_pdf or raw.startswith(b"%PDF-")


def _part(part, where: str, policy: ContentPolicy, in_tool_output: bool):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS:
        return str(part.get("text", ""))
    if kind in ("input_image", "image_url"):
        if policy.images is None and in_tool_output:
            return policy.image_placeholder()
        return from_openai_part(part, where, policy.images, "input")
    if kind in ("input_video", "video_url"):
        return video.from_openai_part(part, where, policy.images)
    if kind in ("input_audio", "audio_url"):
        return audio_parts.from_openai_part(part, where)
    if kind == "input_file":
        if id(part) in policy.documents:
            return titled(policy.documents[id(part)], part.get("filename"))
        raw, _ = _file_bytes(part, where)
        return titled(text_file(raw, where, "input"), part.get("filename"))
    return None  # refusals, annotations and other parts carry nothing the template uses


def _content(content, where: str, policy: ContentPolicy, in_tool_output: bool = False) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of content parts", "input")
    pieces = (_part(x, f"{where}[{j}]", policy, in_tool_output) for j, x in enumerate(content))
    return join_content([x for x in pieces if x is not None])


def _function_call(item: dict) -> dict:
    """A function_call or custom_tool_call sent back, as the template's tool call."""
    raw = custom_arguments(item) if item.get("type") == "custom_tool_call" else item.get("arguments")
    args = template_arguments(raw or "{}")
    return {"id": item.get("call_id"), "type": "function", "function": {"name": joined_name(item), "arguments": args}}


def _tool_output(item: dict, where: str, policy: ContentPolicy) -> dict:
    output = item.get("output")
    if isinstance(output, list):
        content = _content(output, f"{where}.output", policy, in_tool_output=True)
    else:
        content = output if isinstance(output, str) else json.dumps(output)
    return {"role": "tool", "tool_call_id": item.get("call_id"), "content": content}


def items_to_messages(items, policy: ContentPolicy) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise invalid("'input' must be a string or a list of items", "input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise invalid(f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid(f"input[{i}].role must be user, assistant, system or developer", "input")
            content = _content(item.get("content"), f"input[{i}].content", policy)
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind in ("function_call", "custom_tool_call"):
            call = _function_call(item)
            if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append(_tool_output(item, f"input[{i}]", policy))
        # reasoning, item_reference, additional_tools (read by parse_tools) and hosted-tool
        # items carry nothing the template can use
    return messages


def _pdf_parts(items):
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        parts = item.get("content") or item.get("output") if isinstance(item, dict) else None
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            if isinstance(part, dict) and part.get("type") == "input_file":
                where = f"input[{i}].content[{j}]"
                raw, is_pdf = _file_bytes(part, where)
                if is_pdf:
                    yield part, raw, where


def _tool_choice(choice, tools: ResponsesTools):
    """Responses' tool_choice in Chat's spelling: a named function or custom tool."""
    if not isinstance(choice, dict) or choice.get("type") not in ("function", "custom"):
        return choice
    name = choice.get("name")
    if not isinstance(name, str):
        raise invalid(f"tool_choice of type {choice['type']!r} needs a 'name' string", "tool_choice")
    # a tool in a namespace is named without it (it is offered as namespace__name)
    offered = [x["function"]["name"] for x in tools.tools]
    if name not in offered:
        name = next((n for n in offered if split_name(n)["name"] == name), name)
    return {"type": "function", "function": {"name": name}}


def _constraint(f: ResponsesFields, tools: ResponsesTools | None) -> dict | None:
    fmt = (f.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise invalid('text.format must be an object such as {"type": "json_schema", ...}', "text")
    choice = _tool_choice(f.tool_choice, tools or ResponsesTools())
    return openai_constraint(
        fmt, choice, tools.for_constraint() if tools else None, "text.format", "text.format.schema", "text"
    )


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _logprobs(f: ResponsesFields) -> int | None:
    """include: ["message.output_text.logprobs"] (or top_logprobs) asks for logprobs."""
    include, top = f.include or [], f.top_logprobs
    return (top or 0) if LOGPROBS_INCLUDE in include or top is not None else None


def parse(
    body: dict,
    history: list[dict],
    policy: ContentPolicy,
    tools: ResponsesTools,
    f: ResponsesFields | None = None,
) -> ParsedRequest:
    """The request, in one pass over `f` (the body as decoded by serving.handle; decoded here
    when called without it), each field checked once."""
    f = f or decode_fields(body, ResponsesFields)
    if f.input is None:
        raise invalid("missing required parameter: 'input'", "input")
    messages = history + items_to_messages(f.input, policy)
    offered = None if f.tool_choice == "none" or not tools.tools else tools
    return ParsedRequest(
        messages=([{"role": "system", "content": f.instructions}] if f.instructions else []) + messages,
        tools=offered.tools if offered else None,
        constraint=_constraint(f, offered),
        omitted=policy.omitted,
        logprobs=_logprobs(f),
        cache_retention_s=openai_retention(f.prompt_cache_retention),
        **f.request_fields(),
    )


class Responses(McpFamily):
    Fields = ResponsesFields
    tools: ResponsesTools  # what parse offered, set by parse
    stored: list[dict]  # the conversation kept for previous_response_id, set by parse

    async def parse(self, fields: ResponsesFields) -> ParsedRequest:
        self.take_mcp_tools(fields)  # MCP tools run by the gateway (gateway/mcp/)
        history: list[dict] = []
        previous = fields.previous_response_id
        if previous:
            if previous not in self.request.app[STORE]:
                raise invalid(f"Previous response with id '{previous}' not found.", "previous_response_id")
            history = list(self.request.app[STORE][previous])
        policy = ContentPolicy(image_limits(self.request, self.slot))
        await read_pdfs(_pdf_parts(fields.input), policy, "input")
        self.tools = parse_tools(fields.tools, fields.input)
        parsed = parse(self.body, history, policy, self.tools, fields)
        # The stored history keeps the images (a follow-up turn sends them again), not the instructions.
        self.stored = parsed.messages[1:] if fields.instructions else parsed.messages
        if self.tools.ignored:
            self.headers["x-mlxgw-ignored-tools"] = ",".join(self.tools.ignored)
        return parsed

    # The response object echoes the body as sent (self.body), MCP tools included.
    def emitter(self, sse, gen: Generation) -> ResponseEvents:
        return ResponseEvents(sse, gen, self.request, self.body, self.stored, self.tools.custom)

    def render(self, gen: Generation, out: Outcome) -> dict:
        return render(self.request, self.body, gen, out, self.stored, self.tools.custom)

    def mcp_hooks(self) -> McpHooks:
        return responses_hooks(self.stored)


@routes.post("/v1/responses")
async def responses(request: web.Request) -> web.StreamResponse:
    return await handle(request, Responses)
