"""How the Responses API shows the MCP calls the gateway ran: `mcp_call` output items,
streamed as OpenAI streams them (response.output_item.added,
response.mcp_call_arguments.delta/done, response.mcp_call.in_progress,
response.mcp_call.completed or .failed, response.output_item.done)."""

from __future__ import annotations

from ...mcp.drive import McpHooks
from ...mcp.loop import McpCall
from .output import new_item_id


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
    if not hasattr(out, "mcp_items"):
        out.mcp_items = {}
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
