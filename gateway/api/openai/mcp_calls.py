"""How Chat Completions shows the MCP calls the gateway ran (the Responses API's `mcp_call`
items are in gateway/api/responses/mcp_items.py).

An mlxgw extension: a streamed MCP call is a tool-call delta marked
`"mlxgw_mcp": {"server_label": ...}` (its index continues the turn's numbering), and its
result a delta `"mlxgw_mcp_result": {id, server_label, name, arguments, output, error}`; a
non-streamed message lists the calls in `message.mlxgw_mcp_calls`. A client must not run a
tool call marked `mlxgw_mcp`: the gateway already did."""

from __future__ import annotations

from ...mcp.drive import McpHooks
from ...mcp.loop import McpCall


async def _chat_call(out, call: dict, label: str) -> None:
    delta = {
        "index": call["index"],
        "id": call["id"],
        "type": "function",
        "function": {"name": call["name"], "arguments": call["arguments"]},
        "mlxgw_mcp": {"server_label": label},
    }
    await out.sse.data(out.delta({"tool_calls": [delta]}))


async def _chat_result(out, r: McpCall) -> None:
    await out.sse.data(out.delta({"mlxgw_mcp_result": r.as_dict()}))


def _chat_decorate(body: dict, calls: list[McpCall]) -> None:
    if calls:
        body["choices"][0]["message"]["mlxgw_mcp_calls"] = [c.as_dict() for c in calls]


def chat_hooks() -> McpHooks:
    return McpHooks(_chat_call, _chat_result, _chat_decorate)
