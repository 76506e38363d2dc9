"""Who may use which MCP server: a tool runs with arguments the caller (or its
model) chooses, on a server the operator set up, so using one is the operator's grant.

- Keys off: everyone is the operator; every server.
- An admin key: every server.
- Another key: the servers its keys.yaml entry lists under `mcp:` (labels or globs, "*" for
  all); without that field, the servers whose config sets `allowed_tools` (the operator chose
  what they expose). A server that exposes every tool it lists (no `allowed_tools`) is never
  reached by an ordinary key unless its `mcp:` names it.

A server a key may not use is answered as an unknown label (its name is not confirmed)."""

from __future__ import annotations

import fnmatch

from aiohttp import web

from ...shared.errors import ErrorCode, ServiceError
from .server import McpServer


def may_use(request: web.Request, server: McpServer) -> bool:
    key = request.get("key")
    if key is None or key.admin:
        return True
    if key.mcp is not None:
        return any(fnmatch.fnmatchcase(server.label, pattern) for pattern in key.mcp)
    return server.cfg.allowed_tools is not None


def check(request: web.Request, server: McpServer, label: str, param: str) -> McpServer:
    if not may_use(request, server):
        raise ServiceError(
            ErrorCode.INVALID_REQUEST,
            f"unknown MCP server_label '{label}': ask the server's operator which MCP servers it offers",
            param=param,
        )
    return server
