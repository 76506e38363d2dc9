"""Ollama's generating API: POST /api/chat and POST /api/generate, streamed as NDJSON
(Ollama streams by default). Two ApiFamilies on the shared path (serving.handle): the body
becomes a ParsedRequest, and the emitter below writes Ollama's lines.

keep_alive maps to residency (ollama_common.apply_keep_alive); a request with no prompt
(generate) or no messages (chat) only loads or, with keep_alive 0, unloads the model, as
Ollama's clients expect."""

from __future__ import annotations

import json

from aiohttp import web

from ....shared.errors import ErrorCode, ServiceError, invalid
from ....shared.events import Finish
from ...access import audit
from ...models.generation import Generation, Outcome
from ...models.lifecycle import SlotState
from ...pipeline import video
from ...pipeline.fim_support import fim_map
from ...pipeline.images import ImageLimits, from_bare_base64, join_content
from ...pipeline.images import _checked as checked_image
from ...pipeline.serving import ApiFamily, handle
from ...pipeline.stream import Emitter
from ...pipeline.tools import function_tool
from ...pipeline.translate import ParsedRequest, image_limits
from ...web.sse import NDJSONWriter
from ...web.state import MANAGER
from . import common as oc
from .fields import OllamaChatBody, OllamaGenerateBody, OllamaGenerating

routes = web.RouteTableDef()

ROLES = {"system", "user", "assistant", "tool"}


def _images(raw, where: str, limits: ImageLimits | None) -> list[dict]:
    if raw is None or raw == []:
        return []
    if not isinstance(raw, list):
        raise invalid(f"{where}.images must be a list of base64 strings", "images")
    if limits is None:
        raise invalid("this model does not accept images or video; use a vision model", "images")
    return [_image_or_video(x, f"{where}.images[{i}]", limits) for i, x in enumerate(raw)]


def _image_or_video(data, where: str, limits: ImageLimits) -> dict:
    """Ollama has one list for pictures; a video sent in it is told apart by its signature."""
    raw = from_bare_base64(data, where, limits, sniff=False)["source"]
    if video.is_video(raw):
        return {"type": "video", "source": video.checked(raw, where)}
    return {"type": "image", "source": checked_image(raw, where, limits)}


def _tool_calls(raw, where: str) -> list[dict]:
    """Ollama's tool calls (arguments as an object) in the chat template's shape."""
    if not isinstance(raw, list):
        raise invalid(f"{where}.tool_calls must be a list", "messages")
    calls = []
    for call in raw:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"{where}.tool_calls entries need function.name", "messages")
        args = fn.get("arguments") or {}
        if not isinstance(args, dict):
            raise invalid(f"{where}.tool_calls[].function.arguments must be an object", "messages")
        calls.append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
    return calls


def parse_messages(raw, limits: ImageLimits | None) -> list[dict]:
    if not isinstance(raw, list):
        raise invalid("'messages' must be a list", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise invalid(f"{where} must be an object with a role of {', '.join(sorted(ROLES))}", "messages")
        text = m.get("content") or ""
        if not isinstance(text, str):
            raise invalid(f"{where}.content must be a string", "messages")
        msg = {"role": m["role"], "content": join_content([*_images(m.get("images"), where, limits), text])}
        if m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        name = m.get("tool_name") or m.get("name")
        if isinstance(name, str):
            msg["name"] = name
        out.append(msg)
    return out


def parse_tools(raw) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise invalid("'tools' must be a list", "tools")
    tools = []
    for tool in raw:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict):
            raise invalid("each tool must be {'type': 'function', 'function': {...}}", "tools")
        tools.append(function_tool(fn.get("name"), fn.get("description"), fn.get("parameters")))
    return tools or None


def _parsed(f: OllamaGenerating, messages=None, prompt=None, tools=None, fim=None) -> ParsedRequest:
    if f.template:  # a Go template is not run here, and not silently ignored
        raise invalid("'template' is not supported by this server", "template")
    return ParsedRequest(
        messages=messages,
        prompt=prompt,
        tools=tools,
        fim=fim,
        constraint=oc.format_constraint(f.format),
        chat_template_kwargs=oc.think_kwargs(f.think),
        **oc.parse_options(f, stream=f.streams()),
    )


def parse_chat(f: OllamaChatBody, limits: ImageLimits | None) -> ParsedRequest:
    messages = parse_messages(f.messages or [], limits)
    return _parsed(f, messages=messages, tools=parse_tools(f.tools))


def parse_generate(f: OllamaGenerateBody, limits: ImageLimits | None) -> ParsedRequest:
    """A prompt through the chat template (with `system`), or as it is with `raw`; with a
    `suffix`, the code around the cursor, filled in the middle (Ollama's `insert`)."""
    if f.suffix:
        if not isinstance(f.suffix, str):
            raise invalid("'suffix' must be a string", "suffix")
        if f.images:
            raise invalid("'suffix' (fill in the middle) takes no 'images'", "images")
        return _parsed(f, fim=fim_map(f.prompt or "", f.suffix))
    images = _images(f.images, "request", limits)
    if f.raw:
        if images or f.system:
            raise invalid("'raw' prompts take no 'images' or 'system'", "raw")
        return _parsed(f, prompt=f.prompt or "")
    messages = [{"role": "system", "content": f.system}] if f.system else []
    messages.append({"role": "user", "content": join_content([*images, f.prompt or ""])})
    return _parsed(f, messages=messages)


async def _load_or_unload(request: web.Request, slot, keep_alive: float | None, shape: str) -> web.Response:
    """A request without input: load the model (or unload it with keep_alive 0)."""
    manager = request.app[MANAGER]
    if keep_alive == 0:
        if not oc.may_set_residency(request):
            await audit.record(request, "models.unload", target=slot.name, change={"keep_alive": 0}, status=403)
            raise ServiceError(
                ErrorCode.PERMISSION,
                "unloading a model needs an admin key (or a key with 'residency: true'); "
                "other keys' keep_alive is ignored",
                param="keep_alive",
            )
        if slot.process is not None and slot.state is SlotState.READY:
            await manager.unload(slot, "keep_alive 0")
        await audit.record(request, "models.unload", target=slot.name, change={"keep_alive": 0}, status=200)
        reason = "unload"
    else:
        await manager.acquire(slot)
        oc.apply_keep_alive(request, slot, keep_alive)
        reason = "load"
    head = {"model": slot.name, "created_at": oc.created_at()}
    empty = {"message": {"role": "assistant", "content": ""}} if shape == "chat" else {"response": ""}
    return web.json_response({**head, **empty, "done": True, "done_reason": reason})


def _no_input(f: OllamaGenerateBody) -> bool:
    return not f.prompt and not f.images and not f.system and not f.suffix


class OllamaFamily(ApiFamily):
    """What /api/chat and /api/generate share: Ollama's model names, NDJSON lines, keep_alive
    applied after the answer, and a request without input that only loads or unloads."""

    writer = NDJSONWriter
    shape = ""  # "chat" or "generate": the output's `message` or `response`
    keep_alive: float | None = None
    loads_only = False  # no input: load the model (or unload it with keep_alive 0)

    def model_name(self, fields: OllamaGenerating) -> str | None:
        return fields.model_name() or None

    def resolve(self, name: str):
        return oc.resolve(self.request, name, self.kinds)

    async def parse(self, fields: OllamaGenerating) -> ParsedRequest:
        self.keep_alive = oc.parse_duration(fields.keep_alive)
        return self.parse_body(fields, image_limits(self.request, self.slot))

    def parse_body(self, fields, limits: ImageLimits | None) -> ParsedRequest:
        raise NotImplementedError

    async def respond(self, parsed: ParsedRequest) -> web.StreamResponse:
        if self.loads_only:
            return await _load_or_unload(self.request, self.slot, self.keep_alive, self.shape)
        try:
            return await super().respond(parsed)
        finally:
            oc.apply_keep_alive(self.request, self.slot, self.keep_alive)

    def emitter(self, sse, gen: Generation) -> OllamaLines:
        return OllamaLines(sse, gen, self.shape)

    def render(self, gen: Generation, out: Outcome) -> dict:
        return {
            "model": gen.model_name,
            "created_at": oc.created_at(),
            **_piece(self.shape, out.text, out.reasoning, out.tool_calls),
            "done": True,
            "done_reason": oc.done_reason(out.finish_reason),
            **oc.timings(gen, out.usage),
        }


class OllamaChat(OllamaFamily):
    Fields = OllamaChatBody
    shape = "chat"

    def parse_body(self, fields: OllamaChatBody, limits: ImageLimits | None) -> ParsedRequest:
        parsed = parse_chat(fields, limits)
        self.loads_only = not parsed.messages
        return parsed


class OllamaGenerate(OllamaFamily):
    Fields = OllamaGenerateBody
    shape = "generate"

    def parse_body(self, fields: OllamaGenerateBody, limits: ImageLimits | None) -> ParsedRequest:
        parsed = parse_generate(fields, limits)
        self.loads_only = _no_input(fields)
        return parsed


@routes.post("/api/chat")
async def chat(request: web.Request) -> web.StreamResponse:
    return await handle(request, OllamaChat)


@routes.post("/api/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    return await handle(request, OllamaGenerate)


# -- output ---------------------------------------------------------------------------------------


def _arguments(raw) -> dict:
    """Ollama gives arguments as an object; text that is not a JSON object is kept under
    "arguments" so nothing the model wrote is lost."""
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        args = None
    return args if isinstance(args, dict) else {"arguments": raw}


def _tool_call(call: dict) -> dict:
    return {"function": {"name": call["name"], "arguments": _arguments(call["arguments"])}}


def _piece(shape: str, text: str = "", thinking: str = "", calls: list[dict] | None = None) -> dict:
    """The output part of one line or body: `message` for chat, `response` for generate."""
    if shape == "chat":
        message = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = [_tool_call(c) for c in calls]
        return {"message": message}
    return {"response": text, **({"thinking": thinking} if thinking else {})}


class OllamaLines(Emitter):
    """One JSON line per piece of output, then a last line with done: true and the counters."""

    def __init__(self, sse, gen: Generation, shape: str):
        super().__init__(sse, gen)
        self.shape = shape

    async def _line(self, piece: dict, done: bool = False) -> None:
        await self.sse.data({"model": self.gen.model_name, "created_at": oc.created_at(), **piece, "done": done})

    async def reasoning(self, text: str) -> None:
        await self._line(_piece(self.shape, thinking=text))

    async def text(self, text: str) -> None:
        await self._line(_piece(self.shape, text))

    async def tool_call(self, call: dict) -> None:
        await self._line(_piece(self.shape, calls=[call]))

    async def finished(self, event: Finish) -> None:
        last = {"done_reason": oc.done_reason(event.reason), **oc.timings(self.gen, self.gen.usage)}
        await self.sse.data(
            {"model": self.gen.model_name, "created_at": oc.created_at(), **_piece(self.shape), "done": True, **last}
        )

    def error_body(self, err: ServiceError) -> dict:
        return {"error": err.message}
