"""GET /v1/mcp/servers, GET /v1/mcp/tools, POST /v1/mcp/execute (admin when keys are on:
it runs a tool with no model and no request in between)."""

from __future__ import annotations

from aiohttp import web

from ...shared.errors import ErrorCode, ServiceError, invalid
from ..pipeline import validate as v
from ..pipeline.body import read_object
from ..web.state import KEYS
from . import access
from .hub import MCP
from .server import McpState

routes = web.RouteTableDef()

FAILED = {"timeout": ErrorCode.TIMEOUT, "unavailable": ErrorCode.MODEL_UNAVAILABLE, "failed": ErrorCode.WORKER_LOST}


@routes.get("/v1/mcp/servers")
async def servers(request: web.Request) -> web.Response:
    hub = request.app[MCP]
    data = [s.describe() for s in hub.servers.values() if access.may_use(request, s)]
    return web.json_response({"object": "list", "data": data})


@routes.get("/v1/mcp/tools")
async def tools(request: web.Request) -> web.Response:
    hub = request.app[MCP]
    data = [
        {
            "server_label": s.label,
            "name": t.name,
            "description": t.description or "",
            "input_schema": t.inputSchema,
        }
        for s in hub.servers.values()
        if access.may_use(request, s)
        for t in s.tools
    ]
    return web.json_response({"object": "list", "data": data})


@routes.post("/v1/mcp/execute")
async def execute(request: web.Request) -> web.Response:
    key = request.get("key")
    if request.app[KEYS] is not None and (key is None or not key.admin):
        raise ServiceError(ErrorCode.PERMISSION, "/v1/mcp/execute needs an admin key")
    body = await read_object(request)
    label = v.string(body, "server_label", required_=True)
    name = v.string(body, "name", required_=True)
    arguments = body.get("arguments") or {}
    if not isinstance(arguments, dict):
        raise invalid("'arguments' must be an object", "arguments")
    server = request.app[MCP].server(label, "server_label")
    if server.state is McpState.READY and server.tool(name) is None:
        raise invalid(f"tool '{name}' is not allowed on MCP server '{label}'", "name")
    result = await server.call(name, arguments)
    if result.status in FAILED:  # the status tells the truth; a tool's own error is still a 200
        raise ServiceError(FAILED[result.status], result.error or "the tool call failed")
    return web.json_response(
        {
            "server_label": label,
            "name": name,
            "output": result.output,
            "error": result.error,
            "is_error": bool(result.error),
        }
    )
