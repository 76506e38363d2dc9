"""A loopback HTTP proxy that records the requests a real client sends (method, path,
headers without credentials, JSON body) and streams the server's answers back unchanged.

The agent tests put it between Claude Code / Codex and `mlxgw up`: what the CLIs really
send becomes a fixture, and a test can assert on it."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass, field

from aiohttp import ClientSession, ClientTimeout, web

SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization"}
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: object  # parsed JSON, the text, or None
    status: int | None = None  # the server's answer
    response_headers: dict[str, str] = field(default_factory=dict)


@dataclass
class RecordingProxy:
    upstream: str
    port: int = 0
    requests: list[RecordedRequest] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RecordingProxy:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("recording proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop and self._runner:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    def posts(self, path_suffix: str) -> list[RecordedRequest]:
        return [r for r in self.requests if r.method == "POST" and r.path.split("?")[0].endswith(path_suffix)]

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        ready.set()
        self._loop.run_forever()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: object = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        headers = {k.lower(): v for k, v in request.headers.items()}
        record = RecordedRequest(
            request.method,
            request.path_qs,
            {k: v for k, v in headers.items() if k not in SECRET_HEADERS and k not in HOP_HEADERS},
            body,
        )
        self.requests.append(record)
        forward = {k: v for k, v in headers.items() if k not in HOP_HEADERS and k != "accept-encoding"}
        async with ClientSession(timeout=ClientTimeout(total=None), auto_decompress=False) as session:
            target = self.upstream + request.path_qs
            async with session.request(request.method, target, data=raw, headers=forward) as up:
                record.status = up.status
                record.response_headers = {k.lower(): v for k, v in up.headers.items()}
                out = web.StreamResponse(status=up.status)
                for k, v in up.headers.items():
                    if k.lower() not in HOP_HEADERS:
                        out.headers[k] = v
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
