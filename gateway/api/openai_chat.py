"""OpenAI Chat Completions: POST /v1/chat/completions."""

from __future__ import annotations

import json

from aiohttp import web
from mlxgw.shared import protocol as p
from mlxgw.shared.errors import invalid

from ..auth import resolve_model
from ..generation import Generation
from . import openai_common as oc
from . import validate as v
from .body import read_json
from .images import ImageLimits, collect_images, from_openai_part, image_limits, join_content

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


def _tool_calls(raw, where: str) -> list[dict]:
    if not isinstance(raw, list):
        raise invalid(f"{where}.tool_calls must be a list", where)
    calls = []
    for call in raw:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"{where}.tool_calls entries need function.name", where)
        args = fn.get("arguments") or "{}"
        try:  # chat templates expect the arguments as an object
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
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


def forced_tool_constraint(choice, tools: list | None) -> dict | None:
    """tool_choice "required" or a named function: enforced by constrained decoding."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        name = None
    elif isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        name = choice["function"]["name"]
    else:
        raise invalid("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', ...}", "tool_choice")
    if not tools:
        raise invalid("tool_choice requires 'tools'", "tool_choice")
    return {"type": "tool_call", "tools": tools, "name": name}


def response_format_constraint(body: dict) -> dict | None:
    """OpenAI response_format as an internal constraint, enforced by constrained decoding."""
    fmt = v.mapping(body, "response_format")
    if body.get("logprobs"):
        raise invalid("logprobs are not supported yet", "logprobs")
    if not fmt or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise invalid("response_format.json_schema.schema must be a JSON schema object", "response_format")
        return {"type": "json_schema", "schema": spec["schema"]}
    raise invalid(
        f"response_format type {fmt['type']!r} is not supported (text, json_object, json_schema)", "response_format"
    )


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = v.require_object(await read_json(request))
    model = v.string(body, "model", required_=True)
    slot = resolve_model(request, model)
    limits = image_limits(request, slot)
    messages, images = await collect_images(parse_messages(v.required(body, "messages"), limits), limits)
    oc.check_unsupported(body)
    constraint = response_format_constraint(body)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid("'tools' must be a list", "tools")
    choice = body.get("tool_choice")
    if choice == "none":
        tools = None
    forced = forced_tool_constraint(choice, tools)
    if forced is not None:
        if constraint is not None:
            raise invalid("response_format and a forced tool_choice cannot be combined", "tool_choice")
        constraint = forced
    template_kwargs = v.mapping(body, "chat_template_kwargs")
    stream, include_usage = oc.stream_options(body)
    req = p.GenerateRequest(
        messages=messages,
        tools=tools or None,
        chat_template_kwargs=template_kwargs,
        constraint=constraint,
        images=images,
        reasoning_budget=v.integer(body, "reasoning_budget", lo=0),  # mlxgw extension
        max_tokens=oc.max_tokens(request, body, slot.entry, "max_completion_tokens", "max_tokens"),
        **oc.base_request(request, body, slot.entry),
    )
    gen = oc.generation(request, slot, req)
    if stream:
        return await _stream(request, gen, include_usage)
    async with gen:
        out = await gen.result()
        return web.json_response(
            {
                "id": oc.new_id("chatcmpl"),
                "object": "chat.completion",
                "created": oc.now(),
                "model": slot.name,
                "choices": [
                    {
                        "index": 0,
                        "message": _message(out),
                        "logprobs": None,
                        "finish_reason": out.finish_reason,
                    }
                ],
                "usage": oc.usage_dict(out.usage),
            }
        )


def _message(out) -> dict:
    message = {"role": "assistant", "content": out.text if out.text or not out.tool_calls else None, "refusal": None}
    if out.reasoning:
        message["reasoning_content"] = out.reasoning
    if out.tool_calls:
        message["tool_calls"] = [_tool_call(c) for c in out.tool_calls]
    return message


def _tool_call(call: dict) -> dict:
    return {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}


async def _stream(request: web.Request, gen: Generation, include_usage: bool) -> web.StreamResponse:
    make = oc.chunk_maker("chat.completion.chunk", "chatcmpl", gen.slot.name, include_usage)

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return make({"delta": delta, "finish_reason": finish})

    def deltas(ev: dict) -> list[dict]:
        out = []
        if ev.get("reasoning"):
            out.append(chunk({"reasoning_content": ev["reasoning"]}))
        if ev.get("text"):
            out.append(chunk({"content": ev["text"]}))
        for call in ev.get("tool_calls") or []:
            # id and name first, then the arguments, as OpenAI streams them
            head = {
                "index": call["index"],
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": ""},
            }
            out.append(chunk({"tool_calls": [head]}))
            out.append(chunk({"tool_calls": [{"index": call["index"], "function": {"arguments": call["arguments"]}}]}))
        return out

    first = chunk({"role": "assistant", "content": ""})
    return await oc.stream_response(request, gen, deltas, lambda reason: chunk({}, reason), include_usage, [first])
