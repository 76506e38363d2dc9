"""OpenAI Responses API: POST /v1/responses (Codex and the openai SDK's `responses`).

Input items become the one internal chat request; output comes back as reasoning,
message and function_call items. `previous_response_id` continues a conversation from a
bounded in-memory store. Hosted tools this server cannot run (web_search, file_search,
computer_use_preview, ...) are left out of the prompt and named in the
`x-mlxgw-ignored-tools` response header instead of refused: refusing them is what makes
Codex unusable with other local servers."""

from __future__ import annotations

import json

from aiohttp import web
from mlxgw.shared import protocol as p
from mlxgw.shared.errors import invalid

from ..auth import resolve_model
from . import openai_common as oc
from . import validate as v
from .body import read_json
from .images import ImageLimits, collect_images, from_openai_part, image_limits, join_content
from .openai_chat import forced_tool_constraint
from .responses_output import NAMESPACE_SEP, STORE, ResponseBuilder, function_call_item, new_item_id, stream_response

routes = web.RouteTableDef()


def _content(content, where: str, images: ImageLimits | None) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content parts", "input")
    pieces: list = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            pieces.append(str(part.get("text", "")))
        elif kind in ("input_image", "image_url"):
            pieces.append(from_openai_part(part, f"{where}.content[{j}]", images, "input"))
        elif kind == "input_file":
            raise invalid("input_file parts are not supported", "input")
    return join_content(pieces)


def _items_to_messages(items, images: ImageLimits | None) -> list[dict]:
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
            messages.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _content(item.get("content"), f"input[{i}]", images),
                }
            )
        elif kind == "function_call":
            args = item.get("arguments") or "{}"
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                pass
            name = item.get("name", "")
            if item.get("namespace"):
                name = f"{item['namespace']}{NAMESPACE_SEP}{name}"
            call = {"id": item.get("call_id"), "type": "function", "function": {"name": name, "arguments": args}}
            if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        # reasoning, item_reference and hosted-tool items carry nothing the template can use
    return messages


def _tools(raw) -> tuple[list[dict] | None, list[str]]:
    """Function tools (namespaces flattened) for the template, and the hosted tools left out."""
    if raw is None:
        return None, []
    if not isinstance(raw, list):
        raise invalid("'tools' must be a list", "tools")
    tools, ignored = [], []

    def add(t: dict, prefix: str = "") -> None:
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": prefix + str(t.get("name")),
                    "description": t.get("description", ""),
                    "parameters": t.get("parameters") or {"type": "object", "properties": {}},
                },
            }
        )

    for t in raw:
        if not isinstance(t, dict):
            raise invalid("each tool must be an object", "tools")
        if t.get("type") == "function":
            add(t)
        elif t.get("type") == "namespace":
            for inner in t.get("tools") or []:
                if isinstance(inner, dict) and inner.get("type", "function") == "function":
                    add(inner, f"{t.get('name')}{NAMESPACE_SEP}")
        else:
            ignored.append(str(t.get("type")))
    return tools or None, ignored


def _constraint(body: dict, tools) -> dict | None:
    fmt = (v.mapping(body, "text") or {}).get("format") or {}
    constraint = None
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("text.format.schema must be a JSON schema object", "text")
        constraint = {"type": "json_schema", "schema": fmt["schema"]}
    elif fmt.get("type") == "json_object":
        constraint = {"type": "json_object"}
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    forced = forced_tool_constraint(choice, tools) if choice != "none" else None
    if forced and constraint:
        raise invalid("text.format and a forced tool_choice cannot be combined", "tool_choice")
    return forced or constraint


@routes.post("/v1/responses")
async def responses(request: web.Request) -> web.StreamResponse:
    body = v.require_object(await read_json(request))
    model = v.string(body, "model", required_=True)
    slot = resolve_model(request, model)
    limits = image_limits(request, slot)
    history: list[dict] = []
    previous = v.string(body, "previous_response_id")
    if previous:
        if previous not in request.app[STORE]:
            raise invalid(f"Previous response with id '{previous}' not found.", "previous_response_id")
        history = list(request.app[STORE][previous])
    history += _items_to_messages(v.required(body, "input"), limits)
    instructions = v.string(body, "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    # The stored history keeps the images (a follow-up turn sends them again).
    messages, images = await collect_images(messages, limits)
    tools, ignored = _tools(body.get("tools"))
    if body.get("tool_choice") == "none":
        tools = None
    req = p.GenerateRequest(
        messages=messages,
        tools=tools,
        constraint=_constraint(body, tools),
        images=images,
        max_tokens=oc.max_tokens(request, body, slot.entry, "max_output_tokens"),
        **oc.base_request(request, {k: body[k] for k in ("temperature", "top_p") if k in body}, slot.entry),
    )
    gen = oc.generation(request, slot, req)
    builder = ResponseBuilder(request, body, slot, gen, history)
    headers = {"x-mlxgw-ignored-tools": ",".join(ignored)} if ignored else {}
    if v.boolean(body, "stream"):
        return await stream_response(request, builder, headers)
    async with gen:
        out = await gen.result()
    if out.reasoning:
        builder.output.append(
            {
                "type": "reasoning",
                "id": new_item_id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": out.reasoning}],
            }
        )
    if out.text or not out.tool_calls:
        builder.output.append(
            {
                "type": "message",
                "id": new_item_id("msg"),
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": out.text, "annotations": [], "logprobs": []}],
            }
        )
    builder.output += [function_call_item(c) for c in out.tool_calls]
    builder.remember(request, out.text, out.tool_calls)
    incomplete = "max_output_tokens" if out.finish_reason == "length" else None
    return web.json_response(builder.snapshot("incomplete" if incomplete else "completed", incomplete), headers=headers)
