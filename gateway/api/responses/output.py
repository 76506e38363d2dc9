"""Responses API output: the response object, its items, and the streamed events."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Set
from dataclasses import dataclass, field

from aiohttp import web

from ....shared.errors import ServiceError
from ....shared.events import Finish
from ...mcp.drive import McpHooks
from ...mcp.loop import McpCall
from ...models.generation import Generation, Outcome
from ...pipeline.stream import Emitter
from ...web.errors import openai_error_body
from ...web.sse import SSEWriter
from .tools import custom_input, split_name

STORE = web.AppKey("responses_store", OrderedDict)
STORE_LIMIT = 1000


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def call_item(call: dict, custom: Set[str] = frozenset()) -> dict:
    """A function_call item, or a custom_tool_call item when the model called a custom tool."""
    head = {"call_id": call["id"], **split_name(call["name"]), "status": "completed"}
    if call["name"] in custom:
        return {"type": "custom_tool_call", "id": new_item_id("ctc"), **head, "input": custom_input(call["arguments"])}
    return {"type": "function_call", "id": new_item_id("fc"), **head, "arguments": call["arguments"]}


@dataclass
class ResponseBuilder:
    """One response object as it fills: its id, its output items, and what is stored for
    previous_response_id."""

    request: web.Request
    body: dict
    gen: Generation
    history: list[dict]  # the conversation so far, stored with this turn appended
    id: str = field(default_factory=lambda: new_item_id("resp"))
    created: int = field(default_factory=lambda: int(time.time()))
    output: list[dict] = field(default_factory=list)

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
            "model": self.gen.model_name,
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
                # cache_write_tokens: the openai SDK's ResponseUsage declares it; the prefix
                # cache is written implicitly, so nothing is billed as a write.
                "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.total_tokens,
            },
        }

    def finish(self, reason: str, text: str, calls: list[dict]) -> dict:
        """The final response object; the turn is stored unless the client said store: false."""
        if self.body.get("store") is not False:
            turn = {"role": "assistant", "content": text}
            if calls:
                turn["tool_calls"] = [
                    {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in calls
                ]
            store = self.request.app[STORE]
            store[self.id] = [*self.history, turn]
            while len(store) > STORE_LIMIT:
                store.popitem(last=False)
        # An answer cut by the server's answer time limit is a completed turn: Codex reads
        # `incomplete` as an error ("Incomplete response returned, reason: max_output_tokens",
        # exit 1) and the answer is lost to it. The log and ledger record the cut.
        cut_by_budget = reason == "length" and not self.gen.time_limited
        incomplete = "max_output_tokens" if cut_by_budget else None
        return self.snapshot("incomplete" if incomplete else "completed", incomplete)


def reasoning_item(text: str) -> dict:
    return {
        "type": "reasoning",
        "id": new_item_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(status: str, content: list[dict]) -> dict:
    return {"type": "message", "id": new_item_id("msg"), "status": status, "role": "assistant", "content": content}


def render(
    request: web.Request, body: dict, gen: Generation, out: Outcome, history: list[dict], custom: Set[str] = frozenset()
) -> dict:
    """A non-streamed response; `custom`: the exposed names of the custom tools."""
    builder = ResponseBuilder(request, body, gen, history)
    if out.reasoning:
        builder.output.append(reasoning_item(out.reasoning))
    if out.text or not out.tool_calls:
        builder.output.append(message_item("completed", [text_part(out.text, out.logprobs)]))
    builder.output += [call_item(c, custom) for c in out.tool_calls]
    return builder.finish(out.finish_reason, out.text, out.tool_calls)


class ResponseEvents(Emitter):
    """Output items as they stream: at most one reasoning and one message item open; every
    event numbered by sequence_number."""

    error_event = "error"

    def __init__(
        self,
        sse: SSEWriter,
        gen: Generation,
        request: web.Request,
        body: dict,
        history: list[dict],
        custom: Set[str] = frozenset(),
    ):
        super().__init__(sse, gen)
        self.custom = custom
        self.builder = ResponseBuilder(request, body, gen, history)
        self.seq = 0
        self.reasoning_item: dict | None = None
        self.message: dict | None = None
        self.texts: list[str] = []
        self.calls: list[dict] = []
        self.logprob_entries: list[dict] = []
        self.mcp_items: dict[str, dict] = {}  # the MCP calls shown, by call id (_responses_call below)

    async def emit(self, kind: str, **fields) -> None:
        await self.sse.data({"type": kind, "sequence_number": self.seq, **fields}, kind)
        self.seq += 1

    def _index(self, item: dict) -> int:
        return next(i for i, x in enumerate(self.builder.output) if x is item)

    async def _add(self, item: dict) -> None:
        self.builder.output.append(item)
        await self.emit("response.output_item.added", output_index=self._index(item), item=item)

    async def opened(self) -> None:
        await self.emit("response.created", response=self.builder.snapshot("in_progress"))
        await self.emit("response.in_progress", response=self.builder.snapshot("in_progress"))

    async def reasoning(self, text: str) -> None:
        if self.reasoning_item is None:
            self.reasoning_item = reasoning_item("")
            await self._add(self.reasoning_item)
        r = self.reasoning_item
        r["content"][0]["text"] += text
        await self.emit(
            "response.reasoning_text.delta", item_id=r["id"], output_index=self._index(r), content_index=0, delta=text
        )

    async def _close_reasoning(self) -> None:
        r, self.reasoning_item = self.reasoning_item, None
        if r is not None:
            text, idx = r["content"][0]["text"], self._index(r)
            await self.emit(
                "response.reasoning_text.done", item_id=r["id"], output_index=idx, content_index=0, text=text
            )
            await self.emit("response.output_item.done", output_index=idx, item=r)

    async def text_with_logprobs(self, text: str, entries: list[dict]) -> None:
        await self.text(text, entries)

    async def logprobs(self, entries: list[dict]) -> None:
        self.logprob_entries += entries  # tokens that became reasoning or tool calls: in the final part

    async def text(self, text: str, entries: list[dict] | None = None) -> None:
        await self._close_reasoning()
        if self.message is None:
            self.message = message_item("in_progress", [])
            await self._add(self.message)
            m, idx = self.message, self._index(self.message)
            await self.emit(
                "response.content_part.added", item_id=m["id"], output_index=idx, content_index=0, part=text_part("")
            )
        self.texts.append(text)
        self.logprob_entries += entries or []
        m = self.message
        await self.emit(
            "response.output_text.delta",
            item_id=m["id"],
            output_index=self._index(m),
            content_index=0,
            delta=text,
            logprobs=entries or [],
        )

    async def _close_message(self) -> None:
        m, self.message = self.message, None
        if m is not None:
            text, idx = "".join(self.texts), self._index(m)
            part = text_part(text, self.logprob_entries)
            await self.emit(
                "response.output_text.done",
                item_id=m["id"],
                output_index=idx,
                content_index=0,
                text=text,
                logprobs=self.logprob_entries,
            )
            await self.emit("response.content_part.done", item_id=m["id"], output_index=idx, content_index=0, part=part)
            m["content"], m["status"] = [part], "completed"
            await self.emit("response.output_item.done", output_index=idx, item=m)

    async def tool_call(self, call: dict) -> None:
        await self._close_reasoning()
        await self._close_message()
        self.calls.append(call)
        done = call_item(call, self.custom)
        if done["type"] == "custom_tool_call":  # streamed as OpenAI streams custom tool calls
            field, event, extra = "input", "response.custom_tool_call_input", {}
        else:
            field, event, extra = "arguments", "response.function_call_arguments", {"name": done["name"]}
        item = {**done, field: "", "status": "in_progress"}
        await self._add(item)
        idx, value = self._index(item), done[field]
        await self.emit(f"{event}.delta", item_id=item["id"], output_index=idx, delta=value)
        await self.emit(f"{event}.done", item_id=item["id"], output_index=idx, **{field: value}, **extra)
        item.update({field: value, "status": "completed"})
        await self.emit("response.output_item.done", output_index=idx, item=item)

    async def finished(self, event: Finish) -> None:
        if not self.builder.output:
            await self.text("")
        await self._close_reasoning()
        await self._close_message()
        final = self.builder.finish(event.reason, "".join(self.texts), self.calls)
        await self.emit(f"response.{final['status']}", response=final)

    def error_body(self, err: ServiceError) -> dict:
        body = openai_error_body(err)["error"]
        return {
            "type": "error",
            "sequence_number": self.seq,
            "code": body["code"],
            "message": body["message"],
            "param": body["param"],
        }


# The MCP calls the gateway ran: `mcp_call` output items, streamed as OpenAI streams them
# (response.output_item.added, response.mcp_call_arguments.delta/done,
# response.mcp_call.in_progress, response.mcp_call.completed or .failed, response.output_item.done).
def mcp_call_item(call: McpCall | dict, label: str, status: str) -> dict:
    is_done = isinstance(call, McpCall)
    return {
        "type": "mcp_call",
        "id": new_item_id("mcp"),
        "server_label": label,
        "name": call.name if is_done else call["name"],
        "arguments": call.arguments if is_done else call["arguments"],
        "output": call.output if is_done else None,
        "error": call.error if is_done else None,
        "status": status,
    }


async def _responses_call(out, call: dict, label: str) -> None:
    await out._close_reasoning()
    await out._close_message()
    item = {**mcp_call_item(call, label, "in_progress"), "arguments": ""}
    out.mcp_items[call["id"]] = item
    await out._add(item)
    idx, args = out._index(item), call["arguments"]
    await out.emit("response.mcp_call_arguments.delta", item_id=item["id"], output_index=idx, delta=args)
    await out.emit("response.mcp_call_arguments.done", item_id=item["id"], output_index=idx, arguments=args)
    item["arguments"] = args
    await out.emit("response.mcp_call.in_progress", item_id=item["id"], output_index=idx)


async def _responses_result(out, r: McpCall) -> None:
    item = out.mcp_items[r.id]
    item.update(output=r.output, error=r.error, status="failed" if r.error else "completed")
    idx = out._index(item)
    await out.emit(f"response.mcp_call.{item['status']}", item_id=item["id"], output_index=idx)
    await out.emit("response.output_item.done", output_index=idx, item=item)


def _responses_decorate(body: dict, calls: list[McpCall]) -> None:
    items = [mcp_call_item(c, c.server_label, "failed" if c.error else "completed") for c in calls]
    body["output"] = items + body["output"]


def responses_hooks(stored: list[dict]) -> McpHooks:
    """`stored`: the history kept for previous_response_id, which gains the MCP turns."""
    return McpHooks(_responses_call, _responses_result, _responses_decorate, [stored])
