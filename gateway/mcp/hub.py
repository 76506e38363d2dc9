"""The app's MCP servers: one background connection task each (started by cleanup_ctx,
cancelled at shutdown), and the lookups the routes and the tool loop need."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from ...shared.errors import ErrorCode, ServiceError
from ...shared.mcp_config import McpConfig
from .server import McpServer, McpState, ToolResult


class McpHub:
    def __init__(self, cfg: McpConfig):
        self.cfg = cfg
        self.servers = {s.label: McpServer(s) for s in cfg.servers}
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(s.run(), name=f"mcp:{s.label}") for s in self.servers.values()]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 10)
        for s in self.servers.values():
            s.state, s.session = McpState.CLOSED, None

    def server(self, label: str, param: str = "tools") -> McpServer:
        """The server a request names; an unknown label is the request's fault (400)."""
        if label not in self.servers:  # the configured labels are not listed: they are the operator's
            raise ServiceError(
                ErrorCode.INVALID_REQUEST,
                f"unknown MCP server_label '{label}': ask the server's operator which MCP servers it offers",
                param=param,
            )
        return self.servers[label]

    def health(self) -> dict:
        return {label: s.state for label, s in self.servers.items()}

    async def execute(self, label: str, name: str, arguments: dict) -> ToolResult:
        return await self.server(label, "server_label").call(name, arguments)


MCP = web.AppKey("mcp", McpHub)


async def mcp_lifecycle(app: web.Application):
    """Connections start in the background: the gateway is ready before any MCP server is."""
    hub = app[MCP]
    hub.start()
    yield
    await hub.close()
