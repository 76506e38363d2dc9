"""MCP tools run by the gateway: connections (server.py), the hub the app holds (hub.py),
the /v1/mcp routes (routes.py) and the server-side tool loop of a chat turn (loop.py)."""
