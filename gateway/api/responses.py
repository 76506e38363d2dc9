"""OpenAI Responses API: POST /v1/responses (Codex and the openai SDK's `responses`).

Input items become the one internal chat request; output comes back as reasoning,
message and function_call items. `previous_response_id` continues a conversation from a
bounded in-memory store. Hosted tools this server cannot run (web_search, file_search,
computer_use_preview, ...) are left out of the prompt and named in the
`x-mlxgw-ignored-tools` response header instead of refused: refusing them is what makes
Codex unusable with other local servers."""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict

from aiohttp import web

from shared import protocol as p
from shared.errors import ServiceError, invalid

from ..auth import resolve_model
from ..generation import Generation, raise_for
from ..sse import SSEWriter
from ..state import SETTINGS
from . import openai_common as oc
from . import validate as v
from .body import read_json
from .errors import openai_error_body
from .openai_chat import forced_tool_constraint

routes = web.RouteTableDef()
STORE = web.AppKey("responses_store", OrderedDict)
STORE_LIMIT = 1000
NAMESPACE_SEP = "__"  # namespace tools are exposed to the model as namespace__function


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _content_text(content, where: str, vision: bool) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            texts.append(str(part.get("text", "")))
        elif kind in ("input_image", "image_url") and not vision:
            raise invalid("this model does not accept images; use a vision model", "input")
        elif kind == "input_file":
            raise invalid("input_file parts are not supported", "input")
    return "\n".join(texts)


def _items_to_messages(items, vision: bool) -> list[dict]:
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
                    "content": _content_text(item.get("content"), f"input[{i}]", vision),
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


def _function_call_item(call: dict) -> dict:
    item = {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call["id"],
        "name": call["name"],
        "arguments": call["arguments"],
        "status": "completed",
    }
    ns, sep, name = call["name"].partition(NAMESPACE_SEP)
    if sep:
        item["namespace"], item["name"] = ns, name
    return item


class ResponseBuilder:
    def __init__(self, request: web.Request, body: dict, slot, gen: Generation, history: list[dict]):
        self.id = _id("resp")
        self.created = int(time.time())
        self.body, self.slot, self.gen, self.history = body, slot, gen, history
        self.output: list[dict] = []

    def snapshot(self, status: str, incomplete: str | None = None) -> dict:
        u = self.gen.usage
        b = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "model": self.slot.name,
            "output": self.output,
            "parallel_tool_calls": True,
            "previous_response_id": b.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None},
            "store": b.get("store", True),
            "temperature": b.get("temperature"),
            "top_p": b.get("top_p"),
            "text": {"format": {"type": "text"}},
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "truncation": "disabled",
            "metadata": b.get("metadata") or {},
            "usage": {
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.total_tokens,
            },
        }

    def remember(self, request: web.Request, text: str, calls: list[dict]) -> None:
        if self.body.get("store") is False:
            return
        turn = {"role": "assistant", "content": text}
        if calls:
            turn["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls
            ]
        store = request.app[STORE]
        store[self.id] = [*self.history, turn]
        while len(store) > STORE_LIMIT:
            store.popitem(last=False)


@routes.post("/v1/responses")
async def responses(request: web.Request) -> web.StreamResponse:
    body = v.require_object(await read_json(request))
    model = v.string(body, "model", required_=True)
    slot = resolve_model(request, model)
    vision = slot.entry.kind == "vision"
    history: list[dict] = []
    previous = v.string(body, "previous_response_id")
    if previous:
        if previous not in request.app[STORE]:
            raise invalid(f"Previous response with id '{previous}' not found.", "previous_response_id")
        history = list(request.app[STORE][previous])
    history += _items_to_messages(v.required(body, "input"), vision)
    instructions = v.string(body, "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    tools, ignored = _tools(body.get("tools"))
    if body.get("tool_choice") == "none":
        tools = None
    req = p.GenerateRequest(
        messages=messages,
        tools=tools,
        constraint=_constraint(body, tools),
        max_tokens=oc.max_tokens(request, body, slot.entry, "max_output_tokens"),
        **oc.base_request(request, {k: body[k] for k in ("temperature", "top_p") if k in body}, slot.entry),
    )
    gen = oc.generation(request, slot, req)
    builder = ResponseBuilder(request, body, slot, gen, history)
    headers = {"x-mlxgw-ignored-tools": ",".join(ignored)} if ignored else {}
    if v.boolean(body, "stream"):
        return await _stream(request, builder, headers)
    async with gen:
        out = await gen.result()
    if out.reasoning:
        builder.output.append(
            {
                "type": "reasoning",
                "id": _id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": out.reasoning}],
            }
        )
    if out.text or not out.tool_calls:
        builder.output.append(
            {
                "type": "message",
                "id": _id("msg"),
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": out.text, "annotations": [], "logprobs": []}],
            }
        )
    builder.output += [_function_call_item(c) for c in out.tool_calls]
    builder.remember(request, out.text, out.tool_calls)
    incomplete = "max_output_tokens" if out.finish_reason == "length" else None
    return web.json_response(builder.snapshot("incomplete" if incomplete else "completed", incomplete), headers=headers)


class _StreamState:
    """Output items as they stream: at most one reasoning and one message item open."""

    def __init__(self, sse: SSEWriter, builder: ResponseBuilder):
        self.sse, self.builder = sse, builder
        self.seq = 0
        self.reasoning: dict | None = None
        self.message: dict | None = None
        self.text: list[str] = []
        self.calls: list[dict] = []

    async def emit(self, kind: str, **fields) -> None:
        await self.sse.data({"type": kind, "sequence_number": self.seq, **fields}, kind)
        self.seq += 1

    def _index(self, item: dict) -> int:
        return next(i for i, x in enumerate(self.builder.output) if x is item)

    async def _add(self, item: dict) -> None:
        self.builder.output.append(item)
        await self.emit("response.output_item.added", output_index=self._index(item), item=item)

    async def reasoning_delta(self, text: str) -> None:
        if self.reasoning is None:
            self.reasoning = {
                "type": "reasoning",
                "id": _id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
            }
            await self._add(self.reasoning)
        self.reasoning["content"][0]["text"] += text
        await self.emit(
            "response.reasoning_text.delta",
            item_id=self.reasoning["id"],
            output_index=self._index(self.reasoning),
            content_index=0,
            delta=text,
        )

    async def close_reasoning(self) -> None:
        if self.reasoning is not None:
            r = self.reasoning
            await self.emit(
                "response.reasoning_text.done",
                item_id=r["id"],
                output_index=self._index(r),
                content_index=0,
                text=r["content"][0]["text"],
            )
            await self.emit("response.output_item.done", output_index=self._index(r), item=r)
            self.reasoning = None

    async def text_delta(self, text: str) -> None:
        await self.close_reasoning()
        if self.message is None:
            self.message = {
                "type": "message",
                "id": _id("msg"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            await self._add(self.message)
            await self.emit(
                "response.content_part.added",
                item_id=self.message["id"],
                output_index=self._index(self.message),
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )
        self.text.append(text)
        await self.emit(
            "response.output_text.delta",
            item_id=self.message["id"],
            output_index=self._index(self.message),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    async def close_message(self) -> None:
        if self.message is not None:
            m, text = self.message, "".join(self.text)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            idx = self._index(m)
            await self.emit(
                "response.output_text.done", item_id=m["id"], output_index=idx, content_index=0, text=text, logprobs=[]
            )
            await self.emit("response.content_part.done", item_id=m["id"], output_index=idx, content_index=0, part=part)
            m["content"], m["status"] = [part], "completed"
            await self.emit("response.output_item.done", output_index=idx, item=m)
            self.message = None

    async def tool_call(self, call: dict) -> None:
        await self.close_reasoning()
        await self.close_message()
        self.calls.append(call)
        item = {**_function_call_item(call), "arguments": "", "status": "in_progress"}
        await self._add(item)
        idx = self._index(item)
        await self.emit(
            "response.function_call_arguments.delta", item_id=item["id"], output_index=idx, delta=call["arguments"]
        )
        await self.emit(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=idx,
            arguments=call["arguments"],
            name=item["name"],
        )
        item.update(arguments=call["arguments"], status="completed")
        await self.emit("response.output_item.done", output_index=idx, item=item)


async def _stream(request: web.Request, builder: ResponseBuilder, headers: dict) -> web.StreamResponse:
    sse = SSEWriter(request, request.app[SETTINGS].write_timeout_s)
    sse.response.headers.update(headers)
    gen = builder.gen
    gen.on_wait = sse.comment
    state = _StreamState(sse, builder)
    try:
        async with gen:
            await state.emit("response.created", response=builder.snapshot("in_progress"))
            await state.emit("response.in_progress", response=builder.snapshot("in_progress"))
            async for ev in gen.events():
                kind = ev["e"] if ev else None
                if kind in (None, p.EV_PROGRESS):
                    await sse.comment()
                    continue
                if kind == p.EV_ERROR or (kind == p.EV_FINISH and ev.get("reason") == "cancelled"):
                    raise_for(ev)
                if ev.get("reasoning"):
                    await state.reasoning_delta(ev["reasoning"])
                if ev.get("text"):
                    await state.text_delta(ev["text"])
                for call in ev.get("tool_calls") or []:
                    await state.tool_call(call)
                if kind == p.EV_FINISH:
                    if not builder.output:
                        await state.text_delta("")
                    await state.close_reasoning()
                    await state.close_message()
                    builder.remember(request, "".join(state.text), state.calls)
                    incomplete = "max_output_tokens" if ev.get("reason") == "length" else None
                    final = builder.snapshot("incomplete" if incomplete else "completed", incomplete)
                    await state.emit("response.incomplete" if incomplete else "response.completed", response=final)
    except ServiceError as err:
        if not sse.opened:
            raise
        body = openai_error_body(err)["error"]
        await sse.error(
            {
                "type": "error",
                "sequence_number": state.seq,
                "code": body["code"],
                "message": body["message"],
                "param": body["param"],
            },
            "error",
        )
    await sse.close()
    return sse.response
