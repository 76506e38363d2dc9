"""Server-sent events over aiohttp's StreamResponse, with a write timeout.

A client that stops reading must not hold a sequence forever: a write that cannot drain
within `write_timeout_s` ends the request (and so cancels it in the worker).

While `hold()` is on, events are gathered and `release()` sends them in one write: a stream
driver holds while more of the model's output is already waiting, so a burst of tokens costs
one socket write instead of one per token (each is still its own event)."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from ...shared.errors import ErrorCode, ServiceError


class SSEWriter:
    def __init__(self, request: web.Request, write_timeout_s: float = 30.0):
        self.request = request
        self.write_timeout_s = write_timeout_s
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "Connection": "keep-alive",
                "X-Accel-Buffering": "no",
            },
        )
        self._holding = False
        self._held: list[bytes] = []

    def hold(self) -> None:
        """From now on, gather events until release() (see the module's docstring)."""
        self._holding = True

    async def release(self) -> None:
        """Send what was gathered (and keep gathering what comes next)."""
        if self._held:
            held, self._held = self._held, []
            await self._send(b"".join(held))

    @property
    def opened(self) -> bool:
        """Something was written (or gathered to be): the status can no longer change."""
        return self.response.prepared or bool(self._held)

    async def open(self) -> None:
        if not self.response.prepared:
            await self.response.prepare(self.request)

    async def _write(self, chunk: bytes) -> None:
        if self._holding:
            self._held.append(chunk)
            return
        await self._send(chunk)

    async def _send(self, chunk: bytes) -> None:
        await self.open()
        try:
            transport = self.request.transport
            if (
                transport is not None
                and not transport.get_write_buffer_size()
                and len(chunk) <= transport.get_write_buffer_limits()[1]
            ):
                # Everything written so far has reached the socket and this chunk stays under
                # the high-water mark: the write cannot pause for the client, so no timer.
                await self.response.write(chunk)
                return
            # asyncio.timeout, not wait_for: no task per write (a write rarely suspends at all).
            async with asyncio.timeout(self.write_timeout_s):
                await self.response.write(chunk)
        except TimeoutError:
            raise ServiceError(ErrorCode.TIMEOUT, "client stopped reading the stream") from None
        except ConnectionResetError:
            # The client closed the connection between two events. Whether aiohttp cancels
            # the handler first or a write finds the transport closed first is a race; both
            # mean the same thing and must end the request the same way: cancelled (499),
            # not an internal error.
            raise ServiceError(ErrorCode.CANCELLED, "the client closed the connection") from None

    async def data(self, payload: dict | str, event: str | None = None) -> None:
        text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        head = f"event: {event}\n" if event else ""
        await self._write(f"{head}data: {text}\n\n".encode())

    async def comment(self, text: str = "keep-alive") -> None:
        await self._write(f": {text}\n\n".encode())

    async def error(self, payload: dict, event: str | None = None) -> None:
        """Best effort: the stream ends with an error event unless the client is gone."""
        try:
            await self.data(payload, event)
        except (ServiceError, ConnectionResetError):
            pass

    async def close(self) -> None:
        try:
            await self.release()
        except (ServiceError, ConnectionResetError):
            return  # the client is gone or not reading: nothing more can reach it
        finally:
            self._holding = False
        try:
            await self.response.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass


class NDJSONWriter(SSEWriter):
    """Newline-delimited JSON (Ollama's streams): one object per line. The format has no
    comments, so keep-alives write nothing."""

    def __init__(self, request: web.Request, write_timeout_s: float = 30.0):
        super().__init__(request, write_timeout_s)
        self.response.headers["Content-Type"] = "application/x-ndjson"

    async def data(self, payload: dict | str, event: str | None = None) -> None:
        text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        await self._write(f"{text}\n".encode())

    async def comment(self, text: str = "keep-alive") -> None:
        pass
