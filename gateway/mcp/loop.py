"""The server-side tool loop: a request that names MCP servers (a `{"type": "mcp",
"server_label": ...}` tool, or the model's `mcp_servers` default) gets their allow-listed
tools offered as ordinary function tools. While the model calls only MCP tools, the gateway
runs them (the calls of one turn in parallel), appends the results and generates again; as
soon as the model answers with text or calls one of the client's own tools, the turn goes
back to the client as usual.

Bounds: `mcp.max_turns` turns and `mcp.total_timeout_s` for the whole loop; each call
is bounded by its server's `timeout_s`. A failing or hanging tool becomes an error
result fed back to the model (and shown to the client), never a failed request; once a bound
is reached the model is asked once more with the MCP tools withdrawn, so it must answer."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass

from aiohttp import web

from ...shared.errors import ErrorCode, ServiceError, invalid
from ...shared.events import Usage
from ..pipeline.tools import function_tool, template_arguments
from ..pipeline.translate import ParsedRequest
from . import access
from .hub import MCP
from .server import McpServer, McpState


@dataclass
class McpCall:
    """One MCP tool call the gateway ran: what the model asked, what the server answered."""

    id: str
    server_label: str
    name: str
    arguments: str
    output: str | None = None
    error: str | None = None

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "server_label": self.server_label,
            "name": self.name,
            "arguments": self.arguments,
            "output": self.output,
            "error": self.error,
        }


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _requested(spec: dict) -> tuple[str, list[str] | None]:
    label = spec.get("server_label")
    if not isinstance(label, str) or not label:
        raise invalid("an mcp tool needs a 'server_label' string", "tools")
    allowed = spec.get("allowed_tools")
    if isinstance(allowed, dict):  # OpenAI's filter form: {"tool_names": [...]}
        allowed = allowed.get("tool_names")
    if allowed is not None and not (isinstance(allowed, list) and all(isinstance(x, str) for x in allowed)):
        raise invalid("mcp allowed_tools must be a list of tool names", "tools")
    return label, allowed


def _tool_name(tool: dict) -> str:
    return (tool.get("function") or {}).get("name") or tool.get("name") or ""


class ToolLoop:
    """The MCP tools one request offers, and the bookkeeping of its loop."""

    def __init__(self, request: web.Request, slot, specs: list[dict], client_tools: list | None):
        hub = request.app[MCP]
        self.cfg = hub.cfg
        self.tools: dict[str, McpServer] = {}
        self.offered: list[dict] = []
        labels = [_requested(s) for s in specs] or [(label, None) for label in slot.entry.mcp_servers]
        client_names = {_tool_name(x) for x in client_tools or [] if isinstance(x, dict)}
        for label, allowed in labels:
            server = hub.server(label)
            if not specs and not access.may_use(request, server):
                continue  # a model's default server this key may not use: the model serves without it
            access.check(request, server, label, "tools")
            if server.state is not McpState.READY and not specs:
                continue  # a model's default server that is down: the model still serves without it
            if server.state is not McpState.READY:
                raise ServiceError(
                    ErrorCode.MODEL_UNAVAILABLE,
                    f"MCP server '{label}' is {server.state}: {server.last_error or 'not connected yet'}",
                    param="tools",
                    retry_after=2,
                )
            for tool in server.tools:
                if allowed is not None and tool.name not in allowed:
                    continue
                if tool.name in self.tools or tool.name in client_names:
                    raise invalid(
                        f"tool name '{tool.name}' is offered twice (MCP servers or the request's tools)", "tools"
                    )
                self.tools[tool.name] = server
                self.offered.append(function_tool(tool.name, tool.description, tool.inputSchema))
        self.deadline = time.monotonic() + self.cfg.total_timeout_s
        self.turns = 0
        self.calls: list[McpCall] = []
        self.usage = Usage()

    @property
    def active(self) -> bool:
        return bool(self.tools)

    def offering(self) -> bool:
        """Whether this turn still offers the MCP tools (turns and time left)."""
        return self.turns < self.cfg.max_turns and time.monotonic() < self.deadline

    def prepare(self, parsed: ParsedRequest, client_tools: list | None) -> None:
        """The tools of the next turn; a forced tool call holds for the first turn only."""
        if self.offering():
            parsed.tools = [*(client_tools or []), *self.offered]
        else:
            parsed.tools = client_tools or None
        if self.turns > 0 and (parsed.constraint or {}).get("type") == "tool_call":
            parsed.constraint = None

    def is_mcp(self, call: dict) -> bool:
        return call["name"] in self.tools

    def add_usage(self, u: Usage) -> Usage:
        self.usage.prompt_tokens += u.prompt_tokens
        self.usage.completion_tokens += u.completion_tokens
        self.usage.cached_tokens += u.cached_tokens
        return Usage(self.usage.prompt_tokens, self.usage.completion_tokens, self.usage.cached_tokens)

    async def run(self, calls: list[dict]) -> list[McpCall]:
        """Run one turn's MCP calls in parallel, each bounded by its timeout and the time left."""
        self.turns += 1
        left = max(self.deadline - time.monotonic(), 0.001)

        async def one(call: dict) -> McpCall:
            server = self.tools[call["name"]]
            done = McpCall(call["id"] or new_call_id(), server.label, call["name"], call["arguments"])
            try:
                args = json.loads(call["arguments"] or "{}")
            except ValueError:
                args = None
            if not isinstance(args, dict):
                done.error = "the arguments are not a JSON object"
                return done
            result = await server.call(call["name"], args, left)
            done.output, done.error = result.output, result.error
            return done

        results = list(await asyncio.gather(*(one(c) for c in calls)))
        self.calls += results
        return results

    @staticmethod
    def extend(messages: list[dict], text: str, results: list[McpCall], *also: list[dict]) -> None:
        """The MCP turn in the conversation: the assistant's calls, then one tool message each."""
        calls = [
            {"id": r.id, "type": "function", "function": {"name": r.name, "arguments": template_arguments(r.arguments)}}
            for r in results
        ]
        turn = [{"role": "assistant", "content": text, "tool_calls": calls}]
        turn += [
            {"role": "tool", "tool_call_id": r.id, "content": f"error: {r.error}" if r.error else (r.output or "")}
            for r in results
        ]
        targets = {id(x): x for x in (messages, *also)}  # Responses may store the very same list
        for target in targets.values():
            target.extend(turn)
