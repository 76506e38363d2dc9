"""One MCP server's connection, owned by a background task: connect, list tools, keep the
session alive with pings, reconnect with backoff when it fails. Start-up never waits on it;
a server that cannot connect is reported (state, last_error), never fatal."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta

from ...shared.errors import redact_paths
from ...shared.events import WireEnum
from ...shared.mcp_config import McpServerConfig
from .stderr_log import throttled_stderr

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
PING_EVERY_S = 5.0  # how soon a dead server is noticed


class McpState(WireEnum):
    """An MCP server link's state, as /v1/status and errors name it."""

    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


@dataclass
class ToolResult:
    output: str
    error: str | None = None  # set when the call failed, timed out or the tool reported an error
    # ok | tool_error (the tool answered with an error) | timeout | unavailable | failed (transport)
    status: str = "ok"


def _describe(err: BaseException) -> str:
    """A one-line reason; anyio wraps transport failures in exception groups."""
    while getattr(err, "exceptions", None):
        err = err.exceptions[0]
    return redact_paths(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__)


def _content_text(result) -> str:
    parts = []
    for block in result.content or []:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else json.dumps(block.model_dump(mode="json")))
    return "\n".join(parts)


class McpServer:
    def __init__(self, cfg: McpServerConfig):
        self.cfg = cfg
        self.state = McpState.CONNECTING
        self.last_error: str | None = None
        self.tools: list = []  # mcp.types.Tool, allow-listed
        self.session = None  # mcp.ClientSession while ready
        self.connected_at: float | None = None
        self.attempts = 0
        self._recovery = asyncio.Lock()  # retries after a crash, one at a time
        self.generation = 0  # counts the sessions held so far
        self._dead: set[int] = set()  # generations of sessions a call saw fail
        self._broken = asyncio.Event()  # a call saw the connection fail: reconnect now

    @property
    def label(self) -> str:
        return self.cfg.label

    def tool(self, name: str):
        return next((t for t in self.tools if t.name == name), None)

    def describe(self) -> dict:
        return {
            "label": self.label,
            "transport": self.cfg.transport,
            "state": self.state,
            "tool_count": len(self.tools),
            "allowed_tools": self.cfg.allowed_tools,
            "timeout_s": self.cfg.timeout_s,
            "last_error": self.last_error,
            "connected_at": self.connected_at,
            "connect_attempts": self.attempts,
        }

    @asynccontextmanager
    async def _streams(self):
        # Imported here: the SDK (pydantic, starlette, ...) costs a gateway without MCP
        # servers over half a second of start-up.
        from mcp import StdioServerParameters
        from mcp.client.stdio import get_default_environment, stdio_client
        from mcp.client.streamable_http import streamablehttp_client

        if self.cfg.command:
            # The default environment (PATH, HOME, ...) plus the configured variables: the
            # gateway's own environment (keys, tokens) is not handed to a tool process.
            params = StdioServerParameters(
                command=self.cfg.command, args=self.cfg.args, env={**get_default_environment(), **self.cfg.env}
            )
            with throttled_stderr(self.label) as errlog:
                async with stdio_client(params, errlog=errlog) as (read, write):
                    yield read, write
        else:
            async with streamablehttp_client(self.cfg.url, timeout=self.cfg.connect_timeout_s) as (r, w, _):
                yield r, w

    async def run(self) -> None:
        """The connection task: until cancelled, connect and hold the session."""
        backoff = BACKOFF_FIRST_S
        while True:
            self.attempts += 1
            try:
                await self._hold_session()
            except asyncio.CancelledError:
                raise
            except BaseException as err:  # noqa: BLE001 - anyio raises exception groups
                self.last_error = _describe(err)
            self.session, self.tools, self.state = None, [], McpState.FAILED
            log.warning("MCP server %r unavailable (%s); retrying in %.0f s", self.label, self.last_error, backoff)
            await asyncio.sleep(backoff)
            backoff = BACKOFF_FIRST_S if self.connected_at and time.time() - self.connected_at > 60 else backoff
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _hold_session(self) -> None:
        from mcp import ClientSession

        self.state = McpState.CONNECTING
        async with self._streams() as (read, write), ClientSession(read, write) as session:
            await asyncio.wait_for(session.initialize(), self.cfg.connect_timeout_s)
            listed = await asyncio.wait_for(session.list_tools(), self.cfg.connect_timeout_s)
            self.tools = [t for t in listed.tools if self.cfg.allows(t.name)]
            self.generation += 1
            self.session, self.state, self.connected_at = session, McpState.READY, time.time()
            self.last_error = None
            log.info("MCP server %r ready: %d tools", self.label, len(self.tools))
            self._broken.clear()
            while True:  # a dead process or server shows as a failed ping, or a failed call
                try:
                    await asyncio.wait_for(self._broken.wait(), PING_EVERY_S)
                    raise ConnectionError("a tool call found the connection closed")
                except asyncio.TimeoutError:
                    pass
                await asyncio.wait_for(session.send_ping(), self.cfg.connect_timeout_s)

    async def call(self, name: str, arguments: dict, timeout_s: float | None = None) -> ToolResult:
        """Run one allow-listed tool; every failure is a ToolResult with an error, never raised.

        A call whose transport died (another caller's tool may have crashed the shared stdio
        process) is tried once more on the reconnected session, within its own timeout: one
        crashing call must not fail everyone else's. The crashing call crashes it again and
        fails; a server that stays down fails the retry as unavailable."""
        timeout = min(self.cfg.timeout_s, timeout_s) if timeout_s is not None else self.cfg.timeout_s
        deadline = time.monotonic() + timeout
        result = await self._call_once(name, arguments, timeout)
        if result.status != "failed":
            return result
        # Every call in flight when the process died is a suspect: they retry one at a time,
        # so the culprit ends the next process alone and only its own call fails.
        async with self._recovery:
            if not await self._reconnected(deadline):
                return result
            retry = await self._call_once(name, arguments, max(deadline - time.monotonic(), 0.001))
            if retry.status == "failed":
                retry.error = f"{retry.error} (it ended the MCP server's process again, alone)"
            return retry

    async def _reconnected(self, deadline: float) -> bool:
        """Wait for a session that no call has seen fail."""
        while time.monotonic() < deadline:
            if self.state is McpState.READY and self.session is not None and self.generation not in self._dead:
                return True
            await asyncio.sleep(0.05)
        return False

    async def _call_once(self, name: str, arguments: dict, timeout: float) -> ToolResult:
        generation = self.generation
        result = await self._call_on_session(name, arguments, timeout)
        if result.status == "failed":
            self._dead.add(generation)
            self._broken.set()  # the holder reconnects now instead of at its next ping
        return result

    async def _call_on_session(self, name: str, arguments: dict, timeout: float) -> ToolResult:
        session = self.session
        if session is None or self.state is not McpState.READY:
            why = f"MCP server '{self.label}' is {self.state}: {self.last_error or 'not connected'}"
            return ToolResult("", why, "unavailable")
        if self.tool(name) is None:
            return ToolResult("", f"tool '{name}' is not allowed on MCP server '{self.label}'", "unavailable")
        where = f"tool '{name}' on MCP server '{self.label}'"
        try:
            result = await asyncio.wait_for(
                session.call_tool(name, arguments, read_timeout_seconds=timedelta(seconds=timeout + 1)), timeout
            )
        except asyncio.TimeoutError:
            return ToolResult("", f"{where} timed out after {timeout:g} s", "timeout")
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - the transport's failures become the call's error
            return ToolResult("", f"{where} failed: {_describe(err)}", "failed")
        text = _content_text(result)
        if result.isError:
            return ToolResult(text, text or "the tool reported an error", "tool_error")
        return ToolResult(text)
