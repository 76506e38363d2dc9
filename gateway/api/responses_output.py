"""Responses API output: the response object, its items, and the streamed events."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict

from aiohttp import web
from mlxgw.shared import protocol as p
from mlxgw.shared.errors import ServiceError

from ..generation import Generation
from ..sse import SSEWriter
from ..state import SETTINGS
from .errors import openai_error_body

STORE = web.AppKey("responses_store", OrderedDict)
STORE_LIMIT = 1000
NAMESPACE_SEP = "__"  # namespace tools are exposed to the model as namespace__function


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def function_call_item(call: dict) -> dict:
    item = {
        "type": "function_call",
        "id": new_item_id("fc"),
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
        self.id = new_item_id("resp")
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
                "id": new_item_id("rs"),
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
                "id": new_item_id("msg"),
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
        item = {**function_call_item(call), "arguments": "", "status": "in_progress"}
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


async def stream_response(request: web.Request, builder: ResponseBuilder, headers: dict) -> web.StreamResponse:
    sse = SSEWriter(request, request.app[SETTINGS].write_timeout_s)
    sse.response.headers.update(headers)
    gen = builder.gen
    gen.on_wait = sse.comment
    state = _StreamState(sse, builder)
    try:
        async with gen:
            await state.emit("response.created", response=builder.snapshot("in_progress"))
            await state.emit("response.in_progress", response=builder.snapshot("in_progress"))
            async for ev in gen.content(on_idle=sse.comment):
                kind = ev["e"]
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
