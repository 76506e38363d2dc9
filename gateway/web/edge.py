"""The HTTP edge: what a connection may cost the server before it is a request.

aiohttp gives every connection a file descriptor and a protocol object for as long as the
peer likes, and answers its own parse errors in plain text. Here, per connection:
- an idle timeout (nothing sent, or between keep-alive requests) and a header timeout
  (a request head that is not complete in time: slowloris);
- a body timeout backstop (read_json answers 408 itself; handlers that never read a body
  are covered here);
- a connection cap: past it the oldest connection that holds no work (idle, sending its
  head, or still sending its body) is closed to make room, so /health and control routes
  stay answerable while a flood holds sockets; past a hard ceiling below the process's
  file-descriptor limit, a new connection is closed at once instead of the server running
  out of descriptors;
- aiohttp's own errors (a 10 KB header, a malformed request line) rendered in the error
  shape of the API that was called, and logged at a bounded rate."""

from __future__ import annotations

import asyncio
import logging
import re
import resource
from collections import Counter, OrderedDict
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler

from ...shared.errors import ErrorCode, ServiceError
from .errors import error_response, family_of

log = logging.getLogger(__name__)

# Descriptors kept free: workers' sockets, logs and model files (~128), and the accepts in
# flight: asyncio accepts up to 128 sockets per loop turn, and a socket evicted to make room
# releases its descriptor three or four turns after the one that came in (measured: 384 was
# not enough under a storm of connects).
FD_RESERVE_MIN = 640
SWEEP_S = 1.0
REPORT_S = 10.0
# The request line of a chunk that starts a request: enough to know which API was called
# when aiohttp rejects the rest of the head.
_REQUEST_LINE = re.compile(rb"[A-Z]{3,10} (/[^ ?\r\n]{0,200})")


@dataclass
class EdgeStats:
    """What the edge did, for /metrics and the flood figures."""

    open: int = 0  # connections held now
    peak: int = 0
    evicted: int = 0  # closed to make room past the cap
    refused: int = 0  # closed at once past the hard ceiling
    timed_out: int = 0  # closed by the idle, header or body timeout


EDGE_STATS = web.AppKey("edge_stats", EdgeStats)


@dataclass
class EdgeLimits:
    max_connections: int = 1024  # past it, connections holding no work are closed (oldest first)
    hard_max_connections: int = 4096  # past it, new connections are closed at once
    header_timeout_s: float = 10.0  # first byte of a request head to the complete head
    idle_timeout_s: float = 30.0  # a connection with no request and no bytes of one
    body_timeout_s: float = 60.0  # dispatch of a request to the end of its body


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit where allowed; the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # macOS refuses RLIM_INFINITY (and anything over kern.maxfilesperproc): try smaller.
    for target in (hard, 1 << 20, 65536, 10240):
        if target == resource.RLIM_INFINITY or target <= soft or (hard != resource.RLIM_INFINITY and target > hard):
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            continue
    return soft


def connection_ceiling(fd_limit: int) -> int:
    """The most connections the process can hold with descriptors left for everything else."""
    return max(16, fd_limit - max(FD_RESERVE_MIN, fd_limit // 8))


class EdgeProtocol(RequestHandler):
    """aiohttp's request handler, with the timing the edge needs and API-shaped errors."""

    def __init__(self, manager: EdgeServer, **kwargs):
        super().__init__(manager, **kwargs)
        self.edge = manager
        self.current: web.BaseRequest | None = None  # the request being handled, if any
        self.since = 0.0  # when the current phase began (connection, request, or idle)
        self.head_started: float | None = None  # first byte of a head not yet dispatched
        self.sniffed_path = ""

    # -- bookkeeping ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.since = self._loop.time()
        self.edge.admit(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.edge.forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.current is None and self.head_started is None and data:
            self.head_started = self._loop.time()
        line = _REQUEST_LINE.match(data)
        if line:
            self.sniffed_path = line.group(1).decode("latin-1")
        super().data_received(data)

    def request_started(self, request: web.BaseRequest) -> None:
        self.current, self.since, self.head_started = request, self._loop.time(), None

    def request_ended(self) -> None:
        self.current, self.since = None, self._loop.time()

    def silent(self) -> bool:
        """No request in progress and not a byte of the next one."""
        return self.current is None and self.head_started is None

    def holds_work(self) -> bool:
        """True while a request is being served whose body has arrived: its work must not
        be cut for room. Idle connections, heads and bodies still arriving hold none."""
        return self.current is not None and self.current.content.is_eof()

    def overdue(self, now: float, limits: EdgeLimits) -> str | None:
        if self.current is None:
            if self.head_started is not None and now - self.head_started > limits.header_timeout_s:
                return "head incomplete"
            if self.head_started is None and now - self.since > limits.idle_timeout_s:
                return "idle"
        elif not self.current.content.is_eof() and now - self.since > limits.body_timeout_s + 5:
            return "body incomplete"
        return None

    # -- aiohttp's own errors ------------------------------------------------------------
    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("the response has started; no error response can follow")
        if status >= 500:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
            err = ServiceError(
                ErrorCode.TIMEOUT if status == 504 else ErrorCode.INTERNAL,
                "the request timed out" if status == 504 else "internal server error",
            )
        else:
            if isinstance(exc, LineTooLong):
                detail = f"a request line or header is longer than {exc.args[1]} bytes"
            else:
                detail = (message or str(exc) or "bad request")[:200]
            log.warning("malformed HTTP request from %s: %s", request.remote, detail)
            err = ServiceError(ErrorCode.INVALID_REQUEST, f"malformed HTTP request: {detail}")
        response = error_response(err, family_of(self.sniffed_path or request.path))
        response.force_close()
        return response


class EdgeServer(web.Server):
    """aiohttp's Server, making EdgeProtocols and enforcing the connection limits."""

    limits: EdgeLimits
    stats: EdgeStats
    live: OrderedDict  # EdgeProtocol -> None, oldest first
    sweeper: asyncio.Task | None

    def adopt(self, limits: EdgeLimits, stats: EdgeStats) -> None:
        self.limits, self.stats, self.live, self.sweeper = limits, stats, OrderedDict(), None

    def __call__(self) -> EdgeProtocol:
        return EdgeProtocol(self, loop=self._loop, **self._kwargs)

    def admit(self, proto: EdgeProtocol) -> None:
        self.live[proto] = None
        self.stats.open = len(self.live)
        self.stats.peak = max(self.stats.peak, self.stats.open)
        if len(self.live) <= self.limits.max_connections:
            return
        if self.evict_one(proto, lambda c: not c.holds_work()):
            log.warning("connection cap %d reached: closed the oldest idle or slow connection", len(self.live) - 1)
        elif len(self.live) > self.limits.hard_max_connections:
            self.stats.refused += 1
            log.warning("connection ceiling %d reached: refusing a connection", self.limits.hard_max_connections)
            self.close(proto)

    def evict_one(self, spare: EdgeProtocol, evictable) -> bool:
        """Close the oldest connection (other than spare) that evictable accepts, preferring
        one that never sent a byte of its request: a client that has sent its request may
        be a few milliseconds from holding work, and a flood of connects must not cut it."""
        victim = next((c for c in self.live if c is not spare and c.silent() and evictable(c)), None)
        if victim is None:
            victim = next((c for c in self.live if c is not spare and evictable(c)), None)
        if victim is None:
            return False
        self.stats.evicted += 1
        self.close(victim)
        return True

    def close(self, proto: EdgeProtocol) -> None:
        # Out of the count at once: its descriptor is released on the next loop turn, and
        # a connection being closed must not be picked again.
        self.forget(proto)
        proto.force_close()

    def forget(self, proto: EdgeProtocol) -> None:
        self.live.pop(proto, None)
        self.stats.open = len(self.live)

    async def sweep(self) -> None:
        closed: Counter = Counter()
        reported = self._loop.time()
        while True:
            await asyncio.sleep(SWEEP_S)
            now = self._loop.time()
            for proto in list(self.live):
                reason = proto.overdue(now, self.limits)
                if reason is not None:
                    closed[reason] += 1
                    self.stats.timed_out += 1
                    self.close(proto)
            # One line per REPORT_S at most: a flood times out thousands of sockets.
            if closed and now - reported >= REPORT_S:
                log.info("closed connections past their timeouts: %s", ", ".join(f"{n} {r}" for r, n in closed.items()))
                closed.clear()
                reported = now


class EdgeRunner(web.AppRunner):
    """An AppRunner whose server is an EdgeServer."""

    def __init__(self, app: web.Application, limits: EdgeLimits, **kwargs):
        # aiohttp's own keep-alive timer agrees with ours; its header limits stay default.
        super().__init__(app, keepalive_timeout=limits.idle_timeout_s, **kwargs)
        self.limits = limits

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = EdgeServer  # built by aiohttp, then given the edge's behaviour
        server.adopt(self.limits, self._app[EDGE_STATS])
        server.sweeper = asyncio.get_running_loop().create_task(server.sweep())
        return server

    async def shutdown(self) -> None:
        server = self.server
        if isinstance(server, EdgeServer) and server.sweeper is not None:
            server.sweeper.cancel()
        await super().shutdown()


def make_room(request: web.Request) -> bool:
    """When every request slot is taken: close the oldest request still sending its body
    (a slow sender holds a slot without work) so this one can run. False if none."""
    proto = request.protocol
    if not isinstance(proto, EdgeProtocol):
        return False
    return proto.edge.evict_one(proto, lambda c: c.current is not None and not c.current.content.is_eof())


@web.middleware
async def edge_middleware(request: web.Request, handler):
    """Tell the connection when it holds a request, for its timeouts and the cap."""
    proto = request.protocol
    if not isinstance(proto, EdgeProtocol):
        return await handler(request)
    proto.request_started(request)
    try:
        return await handler(request)
    finally:
        proto.request_ended()


def edge_limits(max_connections: int, header_timeout_s: float, idle_timeout_s: float, body_timeout_s: float):
    """The limits for this process: the descriptor limit raised first, the caps below it."""
    fd_limit = raise_fd_limit()
    ceiling = connection_ceiling(fd_limit)
    limits = EdgeLimits(
        max_connections=min(max_connections, ceiling),
        hard_max_connections=ceiling,
        header_timeout_s=header_timeout_s,
        idle_timeout_s=idle_timeout_s,
        body_timeout_s=body_timeout_s,
    )
    log.info(
        "file-descriptor limit %d: up to %d connections, oldest idle or slow ones closed past %d",
        fd_limit,
        ceiling,
        limits.max_connections,
    )
    return limits
